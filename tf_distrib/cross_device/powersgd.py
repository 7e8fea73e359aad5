"""PowerSGD: rank-r gradient compression with error feedback (Vogels et al., NeurIPS 2019).

A gradient of shape [..., m] is a matrix M (n x m). Each worker sends P = M Q (n x r),
then, with P's sum orthonormalised into P̂, Q' = M^T P̂ (m x r): two all-reduces of
r(n + m) values instead of nm. Every worker rebuilds the same sum P̂ Q'^T; what it
misses of a worker's M stays in that worker's residual E = M - P̂ Q'^T / workers and
joins its next gradient (error feedback: nothing is lost, only delayed); Q' is the next
step's Q (a warm start). E is kept as M, P̂ and Q' and rebuilt as the next gradient is
added (two passes fewer). Vectors and matrices that rank r would not shrink twofold
travel whole in the first all-reduce; the first `start_step` all-reduces send all whole
(as DDP's `powerSGD_hook`). Under Keras' `SGD`, the native ops take its step as they
rebuild the sums (`sgd`). The state (M, P̂, Q', the step count) is in variables of the
worker's own (as a metric's), one state per model's optimizer; `BackupAndRestore` saves
every worker's (`worker_state`).
"""

from __future__ import annotations

import dataclasses
import weakref

import numpy as np
import tensorflow as tf

from tf_distrib import _compat
from tf_distrib._checks import check_int
from tf_distrib.transport import graph_op
from tf_distrib.transport.sgd_step import SgdStep, read_float32

__all__ = ["PowerSGD", "PowerSGDAllReduce"]


@dataclasses.dataclass(frozen=True)
class PowerSGD:
    """The knobs of PowerSGD compression; pass it as `make_strategy(compression=...)`.

    `compression="powersgd"` is `PowerSGD()`.

    Args:
        rank: Rank of each compressed gradient's approximation. Defaults to 4 (within
            one point of float32's held-out accuracy in `tf-distrib bench convergence`).
        start_step: All-reduces sent uncompressed before compression starts.
            Defaults to 100.
        min_size: Smallest gradient (in values) that is compressed. Defaults to 4096.

    Example:

    ```python
    strategy = td.make_strategy(compression=td.cross_device.PowerSGD(rank=2))
    ```
    """

    rank: int = 4
    start_step: int = 100
    min_size: int = 4096

    def __post_init__(self):
        check_int("PowerSGD rank", self.rank)
        check_int("PowerSGD start_step", self.start_step, minimum=0)
        check_int("PowerSGD min_size", self.min_size, minimum=0)

    def compresses(self, shape) -> bool:
        """Whether a gradient of `shape` travels as rank-`rank` factors."""
        if len(shape) < 2:
            return False
        n, m = int(np.prod(shape[:-1])), int(shape[-1])
        r = min(self.rank, n, m)
        return n * m >= self.min_size and 2 * r * (n + m) <= n * m


class PowerSGDAllReduce:
    """Sums float32 gradients across the workers of a transport, PowerSGD-compressed.

    Each owner (a model's optimizer) has a state of its own: models trained one after
    another under one strategy do not inherit each other's residuals or step count.

    Args:
        config: The `PowerSGD` settings.
        transport: The `tf_distrib.transport.Transport` that carries the factors.
    """

    def __init__(self, config: PowerSGD, transport):
        self.config = config
        self.transport = transport
        # Owner -> its _State; the state goes with its owner (a model's M is its size).
        self._states: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def __call__(self, grads: list[tf.Tensor], owner=None) -> list[tf.Tensor]:
        """The sums of `grads` (dense float32), in replica context.

        Args:
            grads: This replica's gradients.
            owner: Whose state the gradients use (the optimizer). Defaults to None: this
                all-reduce's own.
        """
        state, compressed, step = self._begin(grads, owner)
        if not compressed:
            return graph_op.all_reduce(self.transport, grads)
        return tf.cond(step > self.config.start_step,
                       lambda: self._compressed(state, grads, compressed),
                       lambda: graph_op.all_reduce(self.transport, grads))

    def sgd(self, step: SgdStep, grads: list[tf.Tensor], owner=None):
        """Keras' `step` on the sums of `grads` (dense float32), in replica context: fused
        into rebuilding the compressed sums (the transport's `op_library` must be set),
        Keras' own ops on the sums that travel whole. The variables end bitwise as Keras'
        update on `__call__`'s sums leaves them.

        Args:
            step: Keras' step.
            grads: This replica's gradients.
            owner: As `__call__`'s.

        Returns:
            The step's op.
        """
        state, compressed, count = self._begin(grads, owner)

        def whole():
            return step.apply(graph_op.all_reduce(self.transport, grads), range(len(grads)))

        if not compressed:
            return whole()
        return tf.cond(count > self.config.start_step,
                       lambda: self._compressed(state, grads, compressed, step), whole)

    def _begin(self, grads: list[tf.Tensor], owner) -> tuple[_State, list[int], tf.Tensor]:
        """`owner`'s state (built for `grads`), the gradients it compresses, and its step
        count after this all-reduce."""
        state = self._state(owner)
        compressed = [i for i, g in enumerate(grads) if self.config.compresses(g.shape)]
        state.build(grads, compressed, self.config.rank)
        return state, compressed, state.steps.assign_add(1)

    def _state(self, owner) -> _State:
        return self._states.setdefault(self if owner is None else owner, _State())

    def _compressed(self, state: _State, grads: list[tf.Tensor], compressed: list[int],
                    step: SgdStep | None = None):
        """The sums, or with `step` the op that takes it on them (see `sgd`)."""
        whole = [i for i in range(len(grads)) if i not in compressed]
        kernels = _Kernels(self.transport.op_library)
        scale = tf.constant(1.0 / self.transport.world, tf.float32)
        ps = kernels.project(
            [tf.reshape(grads[i], state.matrices[i].shape) for i in compressed],
            [state.matrices[i] for i in compressed],
            [read_float32(state.p_hats[i].handle) for i in compressed],
            [read_float32(state.qs[i].handle) for i in compressed], scale)
        # Round 1: the Ps, and the gradients that travel whole, in one all-reduce.
        sums = graph_op.all_reduce(self.transport, list(ps) + [grads[i] for i in whole])
        p_hats = kernels.orthonormalize(sums[:len(compressed)])
        results = dict(zip(whole, sums[len(compressed):], strict=True))
        # Round 2: the Qs.
        qts = graph_op.all_reduce(self.transport, kernels.back(
            [read_float32(state.matrices[i].handle) for i in compressed], p_hats))
        if step is not None:
            updates = [kernels.rebuild_sgd(p_hats, qts, step, compressed),
                       step.apply([results[i] for i in whole], whole)]
        else:
            updates = []
            for i, approximation in zip(compressed, kernels.rebuild(p_hats, qts), strict=True):
                results[i] = tf.reshape(approximation, grads[i].shape)
        for i, p_hat, q in zip(compressed, p_hats, qts, strict=True):
            updates += [state.p_hats[i].assign(p_hat), state.qs[i].assign(q)]
        with tf.control_dependencies(updates):
            if step is not None:
                return tf.constant(True)  # the branches of `sgd`'s cond return a tensor
            return [tf.identity(results[i]) for i in range(len(grads))]

    # State, for BackupAndRestore -------------------------------------------------

    def worker_state(self, owner=None) -> dict[str, np.ndarray]:
        """This worker's state of `owner` (as `__call__`'s): the step count, and each
        compressed gradient's last M, P̂ and Q' (its residual, see the module's
        docstring); empty before its first step."""
        state = self._state(owner)
        if state.steps is None:
            return {}
        values = {name: _compat.local_value(v) for name, v in state.variables().items()}
        values["steps"] = values["steps"].reshape(1)
        return values

    def load_worker_state(self, rows: dict[str, np.ndarray], row: int, owner=None) -> None:
        """Takes `worker_state` back from saved rows, one per worker that saved them.

        Called before `owner`'s first step (the state exists once a step was traced),
        it takes effect when the state is built.

        Args:
            rows: Each name's values, stacked over the workers that saved them.
            row: This worker's row. When the number of workers changed, every worker
                takes the first row's Qs (equal in every row) and an equal share of
                the residuals' sum, which is what the next sums add back.
            owner: As `__call__`'s.
        """
        world = self.transport.world
        resized = len(rows["steps"]) != world
        values = {"steps": rows["steps"][0][0]}
        for name, v in rows.items():
            kind, _, i = name.partition("/")
            if kind in ("q", "p_hat"):
                values[name] = v[0]
            elif kind == "matrix" and not resized:
                values[name] = v[row]
            elif kind == "matrix":
                # The residuals' sum: every worker's M less the sum all of them applied.
                applied = rows[f"p_hat/{i}"][0].astype(np.float64) @ rows[f"q/{i}"][0]
                values[name] = ((v.sum(axis=0, dtype=np.float64) - applied) / world).astype(
                    np.float32)
                values[f"p_hat/{i}"] = np.zeros_like(rows[f"p_hat/{i}"][0])
        self._state(owner).load(values)


class _State:
    """One owner's state: per-worker variables (SyncOnRead under a strategy), made at its
    first step. Per compressed gradient: Q' (the next Q, transposed), P̂ and M of the
    last step."""

    def __init__(self):
        self.steps: tf.Variable | None = None  # all-reduces run, warm-up included
        self.qs: dict[int, tf.Variable] = {}
        self.p_hats: dict[int, tf.Variable] = {}
        self.matrices: dict[int, tf.Variable] = {}
        self._loaded: dict[str, np.ndarray] = {}  # restored before the state exists

    def build(self, grads: list[tf.Tensor], compressed: list[int], rank: int) -> None:
        """Makes the variables once, for `grads` (the same shapes at every step)."""
        if self.steps is not None:
            return
        with tf.init_scope():
            self.steps = _local_variable(np.int64(0), "powersgd_steps")
            for i in compressed:
                n, m = int(np.prod(grads[i].shape[:-1])), int(grads[i].shape[-1])
                # The same random start on every worker.
                start = np.random.default_rng(i).standard_normal(
                    (min(rank, n, m), m)).astype(np.float32)
                self.qs[i] = _local_variable(start, f"powersgd_q_{i}")
                self.p_hats[i] = _local_variable(np.zeros((n, len(start)), np.float32),
                                                 f"powersgd_p_hat_{i}")
                self.matrices[i] = _local_variable(np.zeros((n, m), np.float32),
                                                   f"powersgd_matrix_{i}")
            # Not as initial values: MWMS gives every worker worker 0's initial values.
            self.load(self._loaded)
            self._loaded = {}

    def load(self, values: dict[str, np.ndarray]) -> None:
        """Assigns `values` (by `variables`' names), or keeps them for `build`."""
        if self.steps is None:
            self._loaded = values
            return
        variables = self.variables()
        for name, value in values.items():
            _compat.assign_local(variables[name], value)

    def variables(self) -> dict[str, tf.Variable]:
        """The variables by their names in `worker_state`."""
        variables = {"steps": self.steps}
        for i in self.qs:
            variables.update({f"q/{i}": self.qs[i], f"p_hat/{i}": self.p_hats[i],
                              f"matrix/{i}": self.matrices[i]})
        return variables


class _Kernels:
    """PowerSGD's arithmetic on N matrices (each n x m, Q transposed: r x m): the native
    ops of `powersgd_ops.cc` when every worker loaded them (the transport's
    `op_library`), else TensorFlow's ops (other bits: all workers take the same path)."""

    def __init__(self, op_library):
        self._ops = op_library

    def project(self, grads, matrices, p_hats, qts, scale):
        """M = G + E into each variable of `matrices`, which holds the last M, and P = M Q,
        for each matrix; E = last M - P̂ Q^T * scale (the last step's factors)."""
        if self._ops is not None:
            return self._ops.tf_distrib_power_sgd_project(
                grads, [v.handle for v in matrices], p_hats, qts, scale)
        ps = []
        for g, variable, p_hat, q in zip(grads, matrices, p_hats, qts, strict=True):
            m = g + (read_float32(variable.handle) - tf.matmul(p_hat, q) * scale)
            with tf.control_dependencies([variable.assign(m)]):
                ps.append(tf.matmul(m, q, transpose_b=True))
        return ps

    def orthonormalize(self, ps):
        """Orthonormal columns spanning each P (Gram-Schmidt's; QR's, up to signs)."""
        if self._ops is not None:
            return self._ops.tf_distrib_power_sgd_orthonormalize(ps)
        return [tf.linalg.qr(p)[0] for p in ps]

    def back(self, matrices, p_hats):
        """Q' = M^T P̂, transposed, for each matrix."""
        if self._ops is not None:
            return self._ops.tf_distrib_power_sgd_back(matrices, p_hats)
        return [tf.matmul(p, m, transpose_a=True) for m, p in zip(matrices, p_hats, strict=True)]

    def rebuild(self, p_hats, qts):
        """The sums P̂ Q'^T."""
        if self._ops is not None:
            return self._ops.tf_distrib_power_sgd_rebuild(p_hats, qts)
        return [tf.matmul(p, q) for p, q in zip(p_hats, qts, strict=True)]

    def rebuild_sgd(self, p_hats, qts, step: SgdStep, indices):
        """`step` taken on the sums P̂ Q'^T of the gradients at `indices`, never written
        out (native ops only).

        Returns:
            The op.
        """
        velocities = [] if step.velocities is None else [
            step.velocities[i].handle for i in indices]
        return self._ops.tf_distrib_power_sgd_rebuild_sgd(
            p_hats, qts, step.learning_rate,
            tf.constant(0.0) if step.momentum is None else step.momentum,
            [step.variables[i].handle for i in indices], velocities, nesterov=step.nesterov)


def _local_variable(initial_value, name: str) -> tf.Variable:
    """A variable of this worker's own (a SyncOnRead one, as a metric's, under a strategy:
    assigned and read in a replica without a collective)."""
    return tf.Variable(initial_value, trainable=False, name=name,
                       synchronization=tf.VariableSynchronization.ON_READ,
                       aggregation=tf.VariableAggregation.SUM)
