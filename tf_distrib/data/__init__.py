"""Dataset sharding: every example once per epoch across all replicas and workers.

Example:

```python
strategy = td.make_strategy()
ds = tf.data.Dataset.from_tensor_slices((x, y))          # unbatched
dist = td.data.distribute_dataset(strategy, ds, global_batch_size=256,
                                  shuffle_buffer=10_000, seed=1)
model.fit(dist, epochs=3)
# Files: whole files per worker when there are enough, records otherwise.
dist = td.data.distribute_dataset(strategy, "data/train-*.tfrecord", 256,
                                  reader=parse_tfrecords)
```
"""

from tf_distrib.data.distribute import (
    DEFAULT_SHARED_SEED,
    SHARD_POLICIES,
    TFDSSource,
    distribute_dataset,
    per_replica_batch_size,
    set_epoch,
    shard_files,
    tfds_source,
)

__all__ = ["distribute_dataset", "per_replica_batch_size", "shard_files",
           "tfds_source", "TFDSSource", "SHARD_POLICIES", "set_epoch", "DEFAULT_SHARED_SEED"]
