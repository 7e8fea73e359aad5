// PowerSGD's arithmetic as four TensorFlow ops (powersgd.py's `_Kernels`).
//
// Each works on N matrices at once (a gradient reshaped to n x m; Q stored transposed,
// r x m, so that every inner loop runs along a row of m contiguous floats):
//   TfDistribPowerSgdProject      M = G + E and P = M Q, in one pass over the row
//   TfDistribPowerSgdOrthonormalize  P̂: P's columns by Gram-Schmidt (double, twice)
//   TfDistribPowerSgdBack         Q' = M^T P̂, by fixed blocks of rows summed in order
//   TfDistribPowerSgdRebuild      A = P̂ Q'^T and the residual M - A * scale, in one pass
// Seven passes over the gradient's size in all, where TensorFlow's matmuls, adds and
// assigns take about thirteen and an op each (the MLP of `bench scaling`, one core,
// AVX2: 3.6 ms against 4.7 ms alone; in `fit`, 4-6 ms less CPU per step, docs/gradients.md).
//
// Why not tf.matmul and tf.linalg.qr: every worker rebuilds A from the same sums, and
// must get the same bits, or the workers' weights drift apart. oneDNN and Eigen pick
// their kernels (and so their order of additions) by the CPU they run on; here each
// output element is summed in an order fixed by the code, with no fused multiply-adds
// (-ffp-contract=off, native_build.py), in 8-lane vectors that the compiler splits into
// SSE2 halves where AVX2 is missing: the same bits on any x86-64 (or other) host.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/util/work_sharder.h"

namespace tf_distrib {
namespace {

using ::tensorflow::OpKernel;
using ::tensorflow::OpKernelConstruction;
using ::tensorflow::OpKernelContext;
using ::tensorflow::OpInputList;
using ::tensorflow::OpOutputList;
using ::tensorflow::Tensor;
using ::tensorflow::TensorShape;

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define VECTOR_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define VECTOR_CLONES
#endif

typedef float v8 __attribute__((vector_size(32)));
constexpr int64_t kLanes = 8;
// Rows per block of TfDistribPowerSgdBack: its partial sums are added in block order.
constexpr int64_t kBlockRows = 64;

inline v8 Load(const float* p) {
  v8 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline void Store(float* p, v8 v) { std::memcpy(p, &v, sizeof(v)); }
inline v8 Splat(float x) { return v8{x, x, x, x, x, x, x, x}; }
inline float Sum(v8 v) {
  float s = 0;
  for (int l = 0; l < kLanes; ++l) s += v[l];
  return s;
}

// Rows [begin, end) of M = G + E and P = M Q (qt: r x m).
VECTOR_CLONES void ProjectRows(const float* g, const float* e, float* m_out, const float* qt,
                               float* p, int64_t m, int64_t r, int64_t begin, int64_t end) {
  const int64_t body = m / kLanes * kLanes;
  for (int64_t i = begin; i < end; ++i) {
    const float* gi = g + i * m;
    const float* ei = e + i * m;
    float* mi = m_out + i * m;
    for (int64_t j = 0; j < body; j += kLanes) Store(mi + j, Load(gi + j) + Load(ei + j));
    for (int64_t j = body; j < m; ++j) mi[j] = gi[j] + ei[j];
    for (int64_t k0 = 0; k0 < r; k0 += 4) {
      const int64_t kk = r - k0 < 4 ? r - k0 : 4;
      v8 acc[4] = {Splat(0), Splat(0), Splat(0), Splat(0)};
      for (int64_t j = 0; j < body; j += kLanes) {
        const v8 v = Load(mi + j);
        for (int64_t k = 0; k < kk; ++k) acc[k] += v * Load(qt + (k0 + k) * m + j);
      }
      for (int64_t k = 0; k < kk; ++k) {
        float s = Sum(acc[k]);
        for (int64_t j = body; j < m; ++j) s += mi[j] * qt[(k0 + k) * m + j];
        p[i * r + k0 + k] = s;
      }
    }
  }
}

// qt_out (r x m) = rows [begin, end) of M, transposed, times P̂: each element summed in
// row order, four rows per load and store of qt_out.
VECTOR_CLONES void BackRows(const float* mm, const float* p, float* qt_out, int64_t m,
                            int64_t r, int64_t begin, int64_t end) {
  const int64_t body = m / kLanes * kLanes;
  std::memset(qt_out, 0, sizeof(float) * r * m);
  for (int64_t i = begin; i < end; i += 4) {
    const int64_t rows = end - i < 4 ? end - i : 4;
    const float* mi[4];
    for (int64_t t = 0; t < 4; ++t) mi[t] = mm + (i + (t < rows ? t : 0)) * m;
    for (int64_t k = 0; k < r; ++k) {
      float pk[4] = {0, 0, 0, 0};
      for (int64_t t = 0; t < rows; ++t) pk[t] = p[(i + t) * r + k];
      float* qk = qt_out + k * m;
      if (rows == 4) {
        const v8 p0 = Splat(pk[0]), p1 = Splat(pk[1]), p2 = Splat(pk[2]), p3 = Splat(pk[3]);
        for (int64_t j = 0; j < body; j += kLanes) {
          v8 q = Load(qk + j);
          q += Load(mi[0] + j) * p0;
          q += Load(mi[1] + j) * p1;
          q += Load(mi[2] + j) * p2;
          q += Load(mi[3] + j) * p3;
          Store(qk + j, q);
        }
      } else {
        for (int64_t t = 0; t < rows; ++t) {
          const v8 pv = Splat(pk[t]);
          for (int64_t j = 0; j < body; j += kLanes) {
            Store(qk + j, Load(qk + j) + Load(mi[t] + j) * pv);
          }
        }
      }
      for (int64_t j = body; j < m; ++j) {
        for (int64_t t = 0; t < rows; ++t) qk[j] += mi[t][j] * pk[t];
      }
    }
  }
}

// Rows [begin, end) of A = P̂ Q'^T and of the residual M - A * scale. A's row is built
// in the output, one k at a time (it stays in L1), each element summed in k's order.
VECTOR_CLONES void RebuildRows(const float* mm, const float* p, const float* qt, float scale,
                               float* a_out, float* e_out, int64_t m, int64_t r,
                               int64_t begin, int64_t end) {
  const int64_t body = m / kLanes * kLanes;
  const v8 sv = Splat(scale);
  for (int64_t i = begin; i < end; ++i) {
    const float* mi = mm + i * m;
    float* ai = a_out + i * m;
    float* ei = e_out + i * m;
    for (int64_t k = 0; k < r; ++k) {
      const float pk = p[i * r + k];
      const v8 pv = Splat(pk);
      const float* qk = qt + k * m;
      if (k == 0) {
        for (int64_t j = 0; j < body; j += kLanes) Store(ai + j, pv * Load(qk + j));
        for (int64_t j = body; j < m; ++j) ai[j] = pk * qk[j];
      } else {
        for (int64_t j = 0; j < body; j += kLanes) Store(ai + j, Load(ai + j) + pv * Load(qk + j));
        for (int64_t j = body; j < m; ++j) ai[j] += pk * qk[j];
      }
    }
    for (int64_t j = 0; j < body; j += kLanes) Store(ei + j, Load(mi + j) - Load(ai + j) * sv);
    for (int64_t j = body; j < m; ++j) ei[j] = mi[j] - ai[j] * scale;
  }
}

// Runs work(begin, end) over [0, rows) on the op's intra-op threads. The outputs of a
// row never depend on how the rows were split.
template <typename Work>
void ForRows(OpKernelContext* ctx, int64_t rows, int64_t cost_per_row, Work work) {
  auto* threads = ctx->device()->tensorflow_cpu_worker_threads();
  ::tensorflow::Shard(threads->num_threads, threads->workers, rows, cost_per_row, work);
}

int64_t Rows(const Tensor& t) { return t.dim_size(0); }
int64_t Cols(const Tensor& t) { return t.dim_size(1); }

class ProjectOp : public OpKernel {
 public:
  explicit ProjectOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    OpInputList grads, residuals, qts;
    OP_REQUIRES_OK(ctx, ctx->input_list("grads", &grads));
    OP_REQUIRES_OK(ctx, ctx->input_list("residuals", &residuals));
    OP_REQUIRES_OK(ctx, ctx->input_list("qts", &qts));
    OpOutputList matrices, ps;
    OP_REQUIRES_OK(ctx, ctx->output_list("matrices", &matrices));
    OP_REQUIRES_OK(ctx, ctx->output_list("ps", &ps));
    for (int i = 0; i < grads.size(); ++i) {
      const Tensor& g = grads[i];
      OP_REQUIRES(ctx, g.dims() == 2 && residuals[i].shape() == g.shape() &&
                           qts[i].dims() == 2 && Cols(qts[i]) == Cols(g),
                  ::tensorflow::errors::InvalidArgument(
                      "matrix ", i, ": gradient ", g.shape().DebugString(), ", residual ",
                      residuals[i].shape().DebugString(), ", Q^T ",
                      qts[i].shape().DebugString()));
      Tensor* m_out = nullptr;  // M may take the gradient's buffer (inputs and outputs
                                // by their flat indices: grads and matrices come first)
      OP_REQUIRES_OK(ctx, ctx->forward_input_or_allocate_output({i}, i, g.shape(), &m_out));
      Tensor* p = nullptr;
      OP_REQUIRES_OK(ctx, ps.allocate(i, TensorShape({Rows(g), Rows(qts[i])}), &p));
      const int64_t m = Cols(g), r = Rows(qts[i]);
      const float *gp = g.flat<float>().data(), *ep = residuals[i].flat<float>().data(),
                  *qp = qts[i].flat<float>().data();
      float *mp = m_out->flat<float>().data(), *pp = p->flat<float>().data();
      ForRows(ctx, Rows(g), m * (2 + 2 * r), [&](int64_t begin, int64_t end) {
        ProjectRows(gp, ep, mp, qp, pp, m, r, begin, end);
      });
    }
  }
};

class OrthonormalizeOp : public OpKernel {
 public:
  explicit OrthonormalizeOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    OpInputList ps;
    OP_REQUIRES_OK(ctx, ctx->input_list("ps", &ps));
    OpOutputList outs;
    OP_REQUIRES_OK(ctx, ctx->output_list("p_hats", &outs));
    for (int i = 0; i < ps.size(); ++i) {
      Tensor* out = nullptr;
      OP_REQUIRES_OK(ctx, outs.allocate(i, ps[i].shape(), &out));
      const int64_t n = Rows(ps[i]), r = Cols(ps[i]);
      const float* in = ps[i].flat<float>().data();
      float* q = out->flat<float>().data();
      // Gram-Schmidt in double, each column orthogonalised twice ("twice is enough":
      // once leaves a nearly dependent column's remainder far from orthogonal, and P̂
      // P̂^T would then be no projection). A zero column (a zero gradient's) stays zeros.
      std::vector<double> w(in, in + n * r);
      for (int64_t k = 0; k < r; ++k) {
        for (int pass = 0; pass < 2; ++pass) {
          for (int64_t l = 0; l < k; ++l) {
            double dot = 0;
            for (int64_t row = 0; row < n; ++row) dot += w[row * r + k] * w[row * r + l];
            for (int64_t row = 0; row < n; ++row) w[row * r + k] -= dot * w[row * r + l];
          }
        }
        double norm = 0;
        for (int64_t row = 0; row < n; ++row) norm += w[row * r + k] * w[row * r + k];
        const double inverse = norm > 0 ? 1.0 / std::sqrt(norm) : 0.0;
        for (int64_t row = 0; row < n; ++row) w[row * r + k] *= inverse;
      }
      for (int64_t j = 0; j < n * r; ++j) q[j] = static_cast<float>(w[j]);
    }
  }
};

class BackOp : public OpKernel {
 public:
  explicit BackOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    OpInputList matrices, p_hats;
    OP_REQUIRES_OK(ctx, ctx->input_list("matrices", &matrices));
    OP_REQUIRES_OK(ctx, ctx->input_list("p_hats", &p_hats));
    OpOutputList qts;
    OP_REQUIRES_OK(ctx, ctx->output_list("qts", &qts));
    for (int i = 0; i < matrices.size(); ++i) {
      const int64_t n = Rows(matrices[i]), m = Cols(matrices[i]), r = Cols(p_hats[i]);
      OP_REQUIRES(ctx, Rows(p_hats[i]) == n,
                  ::tensorflow::errors::InvalidArgument("matrix ", i, ": P has ",
                                                        Rows(p_hats[i]), " rows, M ", n));
      Tensor* out = nullptr;
      OP_REQUIRES_OK(ctx, qts.allocate(i, TensorShape({r, m}), &out));
      // One partial Q' per block of rows, added in block order: the same bits however
      // many threads ran the blocks.
      const int64_t blocks = (n + kBlockRows - 1) / kBlockRows;
      std::vector<float> partial(blocks * r * m);
      const float *mp = matrices[i].flat<float>().data(), *pp = p_hats[i].flat<float>().data();
      ForRows(ctx, blocks, kBlockRows * m * 2 * r, [&](int64_t begin, int64_t end) {
        for (int64_t b = begin; b < end; ++b) {
          BackRows(mp, pp, partial.data() + b * r * m, m, r, b * kBlockRows,
                   std::min(n, (b + 1) * kBlockRows));
        }
      });
      float* q = out->flat<float>().data();
      std::memcpy(q, partial.data(), sizeof(float) * r * m);
      for (int64_t b = 1; b < blocks; ++b) {
        const float* part = partial.data() + b * r * m;
        for (int64_t j = 0; j < r * m; ++j) q[j] += part[j];
      }
    }
  }
};

class RebuildOp : public OpKernel {
 public:
  explicit RebuildOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    OpInputList matrices, p_hats, qts;
    OP_REQUIRES_OK(ctx, ctx->input_list("matrices", &matrices));
    OP_REQUIRES_OK(ctx, ctx->input_list("p_hats", &p_hats));
    OP_REQUIRES_OK(ctx, ctx->input_list("qts", &qts));
    const float scale = ctx->input(3 * matrices.size()).scalar<float>()();
    OpOutputList approximations, residuals;
    OP_REQUIRES_OK(ctx, ctx->output_list("approximations", &approximations));
    OP_REQUIRES_OK(ctx, ctx->output_list("residuals", &residuals));
    const int n_matrices = matrices.size();
    for (int i = 0; i < n_matrices; ++i) {
      const Tensor& mm = matrices[i];
      const int64_t m = Cols(mm), r = Rows(qts[i]);
      Tensor* a = nullptr;
      Tensor* e = nullptr;
      OP_REQUIRES_OK(ctx, approximations.allocate(i, mm.shape(), &a));
      // The residual may take M's buffer: each element of M is read before it is written.
      OP_REQUIRES_OK(ctx, ctx->forward_input_or_allocate_output({i}, n_matrices + i,
                                                                mm.shape(), &e));
      const float *mp = mm.flat<float>().data(), *pp = p_hats[i].flat<float>().data(),
                  *qp = qts[i].flat<float>().data();
      float *ap = a->flat<float>().data(), *ep = e->flat<float>().data();
      ForRows(ctx, Rows(mm), m * (2 * r + 3), [&](int64_t begin, int64_t end) {
        RebuildRows(mp, pp, qp, scale, ap, ep, m, r, begin, end);
      });
    }
  }
};

}  // namespace

using ::tensorflow::shape_inference::InferenceContext;

REGISTER_OP("TfDistribPowerSgdProject")
    .Input("grads: N * float")
    .Input("residuals: N * float")
    .Input("qts: N * float")
    .Output("matrices: N * float")
    .Output("ps: N * float")
    .Attr("N: int >= 1")
    .SetShapeFn([](InferenceContext* c) {
      const int n = c->num_inputs() / 3;
      for (int i = 0; i < n; ++i) {
        c->set_output(i, c->input(i));
        c->set_output(n + i, c->Matrix(c->Dim(c->input(i), 0), c->Dim(c->input(2 * n + i), 0)));
      }
      return ::tensorflow::OkStatus();
    });

REGISTER_OP("TfDistribPowerSgdOrthonormalize")
    .Input("ps: N * float")
    .Output("p_hats: N * float")
    .Attr("N: int >= 1")
    .SetShapeFn([](InferenceContext* c) {
      for (int i = 0; i < c->num_inputs(); ++i) c->set_output(i, c->input(i));
      return ::tensorflow::OkStatus();
    });

REGISTER_OP("TfDistribPowerSgdBack")
    .Input("matrices: N * float")
    .Input("p_hats: N * float")
    .Output("qts: N * float")
    .Attr("N: int >= 1")
    .SetShapeFn([](InferenceContext* c) {
      const int n = c->num_inputs() / 2;
      for (int i = 0; i < n; ++i) {
        c->set_output(i, c->Matrix(c->Dim(c->input(n + i), 1), c->Dim(c->input(i), 1)));
      }
      return ::tensorflow::OkStatus();
    });

REGISTER_OP("TfDistribPowerSgdRebuild")
    .Input("matrices: N * float")
    .Input("p_hats: N * float")
    .Input("qts: N * float")
    .Input("scale: float")
    .Output("approximations: N * float")
    .Output("residuals: N * float")
    .Attr("N: int >= 1")
    .SetShapeFn([](InferenceContext* c) {
      const int n = (c->num_inputs() - 1) / 3;
      for (int i = 0; i < n; ++i) {
        c->set_output(i, c->input(i));
        c->set_output(n + i, c->input(i));
      }
      return ::tensorflow::OkStatus();
    });

REGISTER_KERNEL_BUILDER(Name("TfDistribPowerSgdProject").Device(::tensorflow::DEVICE_CPU),
                        ProjectOp);
REGISTER_KERNEL_BUILDER(
    Name("TfDistribPowerSgdOrthonormalize").Device(::tensorflow::DEVICE_CPU), OrthonormalizeOp);
REGISTER_KERNEL_BUILDER(Name("TfDistribPowerSgdBack").Device(::tensorflow::DEVICE_CPU), BackOp);
REGISTER_KERNEL_BUILDER(Name("TfDistribPowerSgdRebuild").Device(::tensorflow::DEVICE_CPU),
                        RebuildOp);

}  // namespace tf_distrib
