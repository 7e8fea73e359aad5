"""Small datasets shipped with tf_distrib, generated locally (no network).

Example:

```python
import tf_distrib.datasets
tf_distrib.datasets.prepare("/tmp/tfds")            # builds tf_distrib_blobs once
source = td.data.tfds_source("tf_distrib_blobs", "train", data_dir="/tmp/tfds")
dataset = td.data.distribute_dataset(strategy, source, global_batch_size=64)
```
"""

from tf_distrib.datasets.blobs import (
    NAME,
    NUM_CLASSES,
    NUM_EXAMPLES,
    NUM_FEATURES,
    build_model,
    make_data,
    prepare,
)

__all__ = ["NAME", "NUM_CLASSES", "NUM_EXAMPLES", "NUM_FEATURES", "build_model", "make_data",
           "prepare"]
