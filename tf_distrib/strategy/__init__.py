"""One call that picks and configures the right tf.distribute strategy for Keras 3.

Example:

```python
import tf_distrib as td

td.use_logical_cpus(4)          # laptops and tests: 4 replicas on one CPU
strategy = td.make_strategy()   # MWMS under TF_CONFIG, else MirroredStrategy
with strategy.scope():
    model = build_model()
    model.compile(...)
model.fit(dataset, epochs=3)
```
"""

from tf_distrib.contract import STARTUP_TIMEOUT_EXIT_CODE
from tf_distrib.strategy.logical_cpus import use_logical_cpus
from tf_distrib.strategy.make import make_strategy
from tf_distrib.strategy.strategies import (
    HostMirroredStrategy,
    HostOneDeviceStrategy,
    KerasMultiWorkerMirroredStrategy,
)

__all__ = ["make_strategy", "use_logical_cpus", "KerasMultiWorkerMirroredStrategy",
           "HostMirroredStrategy", "HostOneDeviceStrategy", "STARTUP_TIMEOUT_EXIT_CODE"]
