"""PowerSGD's native ops (tf_distrib/cross_device/powersgd_ops.cc) against numpy (float32
where the ops promise bits, float64 otherwise), on shapes that leave every vector loop a
tail, and against TensorFlow's ops."""

import numpy as np
import pytest

from tf_distrib.cross_device.powersgd import _Kernels


@pytest.fixture(scope="module")
def ops():
    from tf_distrib.transport import native_sum

    library = native_sum.library()
    assert library is not None, "the native ops did not build (see the warning)"
    return library


SHAPES = [(67, 13, 1), (130, 40, 3), (64, 1024, 5), (5, 9, 4)]


def _inputs(n, m, r, seed):
    """A gradient, the last M, the last P̂ and Q^T."""
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((n, m)).astype(np.float32),
            rng.standard_normal((n, m)).astype(np.float32),
            rng.standard_normal((n, r)).astype(np.float32),
            rng.standard_normal((r, m)).astype(np.float32))


def _product(p, qt):
    """P Q^T in float32, each element summed in k's order (as the ops sum it)."""
    a = p[:, :1] * qt[0]
    for k in range(1, len(qt)):
        a = a + p[:, k:k + 1] * qt[k]
    return a


def test_each_op_computes_its_formula(ops):
    import tensorflow as tf

    inputs = [_inputs(*shape, seed) for seed, shape in enumerate(SHAPES)]
    scale = np.float32(0.25)
    variables = [tf.Variable(x[1]) for x in inputs]
    held = [v.read_value() for v in variables[:2]]  # these keep the last M: new buffers
    ps = ops.tf_distrib_power_sgd_project(
        [tf.constant(x[0]) for x in inputs], [v.handle for v in variables],
        [tf.constant(x[2]) for x in inputs], [tf.constant(x[3]) for x in inputs], scale)
    p_hats = ops.tf_distrib_power_sgd_orthonormalize(ps)
    matrices = [v.read_value() for v in variables]
    backs = ops.tf_distrib_power_sgd_back(matrices, p_hats)
    approximations = ops.tf_distrib_power_sgd_rebuild(p_hats, backs)
    for value, (_, last, _, _) in zip(held, inputs, strict=False):
        np.testing.assert_array_equal(value, last)
    for i, (g, last, last_p_hat, qt) in enumerate(inputs):
        m = np.asarray(matrices[i])
        np.testing.assert_array_equal(m, g + (last - _product(last_p_hat, qt) * scale))
        want_p = m.astype(np.float64) @ qt.T.astype(np.float64)
        np.testing.assert_allclose(ps[i], want_p, rtol=1e-5, atol=1e-4)
        p_hat = np.asarray(p_hats[i], np.float64)
        r = p_hat.shape[1]
        np.testing.assert_allclose(p_hat.T @ p_hat, np.eye(r), atol=1e-5)
        np.testing.assert_allclose(p_hat @ (p_hat.T @ want_p), want_p, rtol=1e-4, atol=1e-3)
        np.testing.assert_allclose(backs[i], p_hat.T @ m, rtol=1e-5, atol=1e-4)
        np.testing.assert_array_equal(approximations[i],
                                      _product(np.asarray(p_hats[i]), np.asarray(backs[i])))


def test_a_zero_column_stays_zeros_not_nans(ops):
    # A zero gradient makes a zero P: its P̂ is zeros (the approximation then zero, as
    # the gradient), where a division by the norm would make NaNs.
    column = np.arange(1, 7, dtype=np.float32)[:, None]
    p = np.hstack([np.zeros_like(column), column])
    [p_hat] = ops.tf_distrib_power_sgd_orthonormalize([p])
    np.testing.assert_array_equal(np.asarray(p_hat)[:, 0], 0)
    np.testing.assert_allclose(np.asarray(p_hat)[:, 1], column[:, 0] / np.linalg.norm(column),
                               rtol=1e-6)


def test_dependent_columns_still_make_orthonormal_columns(ops):
    # A rank-1 gradient at rank 2: P's second column is the first's, up to rounding;
    # P̂ P̂^T must still be a projection, or the rank-1 sum is not rebuilt.
    column = np.random.default_rng(0).standard_normal((96, 1)).astype(np.float32)
    [p_hat] = ops.tf_distrib_power_sgd_orthonormalize([np.hstack([column, column * 3.3])])
    p_hat = np.asarray(p_hat, np.float64)
    np.testing.assert_allclose(p_hat.T @ p_hat, np.eye(2), atol=1e-6)


def test_the_native_ops_and_tensorflows_make_the_same_sums(ops):
    import tensorflow as tf

    g, last, last_p_hat, qt = (tf.constant(x) for x in _inputs(130, 40, 3, seed=7))
    results = []
    for kernels in (_Kernels(ops), _Kernels(None)):
        matrix = tf.Variable(last)
        ps = kernels.project([g], [matrix], [last_p_hat], [qt], tf.constant(0.5))
        p_hats = kernels.orthonormalize(ps)
        backs = kernels.back([matrix.read_value()], p_hats)
        results.append([matrix.numpy(), np.asarray(kernels.rebuild(p_hats, backs)[0])])
    for native, tensorflow in zip(*results, strict=True):
        np.testing.assert_allclose(native, tensorflow, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("momentum, nesterov", [(None, False), (0.9, False), (0.5, True)])
def test_the_fused_sgd_step_is_keras_step_on_the_rebuilt_sums(ops, momentum, nesterov):
    import tensorflow as tf

    inputs = [_inputs(*shape, seed) for seed, shape in enumerate(SHAPES)]
    p_hats = ops.tf_distrib_power_sgd_orthonormalize([tf.constant(x[2]) for x in inputs])
    qts = [tf.constant(x[3]) for x in inputs]
    approximations = ops.tf_distrib_power_sgd_rebuild(p_hats, qts)
    rng = np.random.default_rng(7)
    weights = [tf.Variable(rng.standard_normal(a.shape).astype(np.float32))
               for a in approximations]
    velocities = [tf.Variable(rng.standard_normal(a.shape).astype(np.float32))
                  for a in approximations] if momentum else []
    for held in (True, False):  # a read holds the old values (a new buffer), then none
        before = [w.read_value() for w in weights + velocities] if held else []
        copies = [np.array(v) for v in before]
        want_w, want_v = [], []
        for k, a in enumerate(approximations):  # Keras' SGD.update_step, op for op
            w, descent = weights[k].numpy(), np.asarray(a) * np.float32(0.05)
            if momentum is None:
                want_w.append(w - descent)
                continue
            v = velocities[k].numpy() * np.float32(momentum) - descent
            want_v.append(v)
            want_w.append(w + (v * np.float32(momentum) - descent if nesterov else v))
        ops.tf_distrib_power_sgd_rebuild_sgd(
            p_hats, qts, tf.constant(0.05), tf.constant(momentum or 0.0, tf.float32),
            [w.handle for w in weights], [v.handle for v in velocities], nesterov=nesterov)
        for variable, want in zip(weights + velocities, want_w + want_v, strict=True):
            np.testing.assert_array_equal(variable.numpy(), want)
        for value, copy in zip(before, copies, strict=True):
            np.testing.assert_array_equal(value, copy)
