"""tf_distrib: fast, fault-tolerant, easy distributed training for TensorFlow / Keras 3.

Example:

```python
import tf_distrib as td

strategy = td.make_strategy()
with strategy.scope():
    model = ...
    model.compile(...)
model.fit(dataset, epochs=3)
```

Importing tf_distrib does not import TensorFlow and changes no global setting:
TensorFlow is imported by the first name that needs it.
"""

import importlib

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
_SUBMODULES = ("callbacks", "chaos", "cluster", "cross_device", "data", "doctor",
               "integrations", "launch", "lr", "model_parallel", "strategy", "testing")

__all__ = ["__version__", *_EXPORTS, *_SUBMODULES]


def __getattr__(name):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
    elif name in _SUBMODULES:
        value = importlib.import_module(f"tf_distrib.{name}")
    else:
        raise AttributeError(f"module 'tf_distrib' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__():
    return sorted(__all__)
