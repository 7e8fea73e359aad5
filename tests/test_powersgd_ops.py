"""PowerSGD's native ops (tf_distrib/cross_device/powersgd_ops.cc) against float64 numpy,
on shapes that leave every vector loop a tail, and against TensorFlow's ops."""

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
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((n, m)).astype(np.float32),
            rng.standard_normal((n, m)).astype(np.float32),
            rng.standard_normal((r, m)).astype(np.float32))


def test_each_op_computes_its_formula(ops):
    import tensorflow as tf

    inputs = [_inputs(*shape, seed) for seed, shape in enumerate(SHAPES)]
    grads, residuals, qts = ([tf.constant(x[k]) for x in inputs] for k in range(3))
    matrices, ps = ops.tf_distrib_power_sgd_project(grads, residuals, qts)
    p_hats = ops.tf_distrib_power_sgd_orthonormalize(ps)
    backs = ops.tf_distrib_power_sgd_back(matrices, p_hats)
    approximations, new_residuals = ops.tf_distrib_power_sgd_rebuild(
        matrices, p_hats, backs, tf.constant(0.25))
    for i, (g, e, qt) in enumerate(inputs):
        m = np.asarray(matrices[i])
        np.testing.assert_array_equal(m, g + e)
        want_p = m.astype(np.float64) @ qt.T.astype(np.float64)
        np.testing.assert_allclose(ps[i], want_p, rtol=1e-5, atol=1e-4)
        p_hat = np.asarray(p_hats[i], np.float64)
        r = p_hat.shape[1]
        np.testing.assert_allclose(p_hat.T @ p_hat, np.eye(r), atol=1e-5)
        np.testing.assert_allclose(p_hat @ (p_hat.T @ want_p), want_p, rtol=1e-4, atol=1e-3)
        np.testing.assert_allclose(backs[i], p_hat.T @ m, rtol=1e-5, atol=1e-4)
        a = np.asarray(approximations[i])
        np.testing.assert_allclose(a, p_hat @ np.asarray(backs[i], np.float64),
                                   rtol=1e-5, atol=1e-4)
        np.testing.assert_array_equal(new_residuals[i], m - a * np.float32(0.25))


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

    g, e, qt = (tf.constant(x) for x in _inputs(130, 40, 3, seed=7))
    results = []
    for kernels in (_Kernels(ops), _Kernels(None)):
        matrices, ps = kernels.project([g], [e], [qt])
        p_hats = kernels.orthonormalize(ps)
        backs = kernels.back(matrices, p_hats)
        results.append([np.asarray(x[0]) for x in kernels.rebuild(
            matrices, p_hats, backs, tf.constant(0.5))])
    for native, tensorflow in zip(*results, strict=True):
        np.testing.assert_allclose(native, tensorflow, rtol=1e-4, atol=1e-4)
