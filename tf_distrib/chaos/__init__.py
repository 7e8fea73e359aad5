"""`tf-distrib chaos`: many trials of a 2-worker job under faults, each checked bitwise.

Each trial runs a small job under `tf-distrib launch` with faults drawn from
`FAULT_KINDS` (SIGKILL, SIGSTOP, SIGTERM, faults in start-up, in a background write,
inside a collective, a full disk). A trial passes when the final weights are bitwise
those of a fault-free run, or, where no recovery is possible, the job fails with a named
error and its newest backup still restores.
Example:

```python
from tf_distrib import chaos

results = chaos.run(trials=5, seed=0, workdir="/tmp/chaos")
print(chaos.table(results))
```
"""

from tf_distrib.chaos.faults import FAULT_KINDS, Fault, draw
from tf_distrib.chaos.run import TrialResult, main, run, run_trial, run_trials, table

__all__ = ["FAULT_KINDS", "Fault", "TrialResult", "draw", "main", "run", "run_trial",
           "run_trials", "table"]
