"""`tf-distrib chaos`: many trials of a 2-worker job under faults, each checked bitwise.

Each trial runs a small job (`tf_distrib.chaos.job`) under `tf-distrib launch` with one
or two faults drawn from `FAULT_KINDS` (`tf_distrib.chaos.faults`): SIGKILL, SIGSTOP,
SIGTERM (preemption), a fault during start-up, a kill during a background write of a
backup, a kill inside a collective, and a full disk at one save. A trial passes when
the job ends with final weights bitwise equal to those of a fault-free run, or, where
no recovery is possible, fails with a named error and its newest backup still
restorable. `make chaos` runs 100 trials; the tests run a short fixed set.

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
