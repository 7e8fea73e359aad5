"""tf_distrib: fast, fault-tolerant, easy distributed training for TensorFlow / Keras 3.

Importing tf_distrib imports no TensorFlow and changes no global setting: TensorFlow is
imported by the first name that needs it.

Example:

```python
import tf_distrib as td

strategy = td.make_strategy()
with strategy.scope():
    model = build_model()
model.fit(dataset, epochs=3)
```
"""

import importlib
import importlib.abc
import importlib.util
import sys

__version__ = "0.1.0"

# Public name -> module that defines it. Resolved on first use (PEP 562) so that
# `import tf_distrib` and the launcher stay light.
_EXPORTS = {
    "ClusterConfigError": "tf_distrib.cluster",
    "ClusterSpec": "tf_distrib.cluster",
    "make_strategy": "tf_distrib.strategy",
    "use_logical_cpus": "tf_distrib.strategy",
    "KerasMultiWorkerMirroredStrategy": "tf_distrib.strategy",
    "HostMirroredStrategy": "tf_distrib.strategy",
    "HostOneDeviceStrategy": "tf_distrib.strategy",
}
_SUBMODULES = ("callbacks", "chaos", "cluster", "contract", "cross_device", "data", "doctor",
               "health", "integrations", "launch", "lr", "model_parallel", "strategy",
               "testing")

__all__ = ["__version__", *_EXPORTS, *_SUBMODULES]

# Modules that moved into the package they serve; their old paths still import.
_MOVED = {
    "tf_distrib.watchdog": "tf_distrib.health.watchdog",
    "tf_distrib.phases": "tf_distrib.health.phases",
    "tf_distrib.failure_report": "tf_distrib.health.failure_report",
    "tf_distrib.simulated_hosts": "tf_distrib.testing.simulated_hosts",
    "tf_distrib.optimizer_hooks": "tf_distrib.strategy.optimizer_hooks",
}


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports a moved module's old path as the module at its new path (one object)."""

    def find_spec(self, fullname, path=None, target=None):
        return importlib.util.spec_from_loader(fullname, self) if fullname in _MOVED else None

    def create_module(self, spec):
        return importlib.import_module(_MOVED[spec.name])

    def exec_module(self, module):
        # The import machinery gave the module the old path's spec: give back its own.
        module.__spec__ = importlib.util.spec_from_file_location(module.__name__,
                                                                 module.__file__)


if not any(isinstance(f, _MovedModules) for f in sys.meta_path):
    sys.meta_path.append(_MovedModules())


def __getattr__(name):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
    elif name in _SUBMODULES or f"tf_distrib.{name}" in _MOVED:
        value = importlib.import_module(f"tf_distrib.{name}")
    else:
        raise AttributeError(f"module 'tf_distrib' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__():
    return sorted(__all__)
