// Views past 2^31 elements (issue 20 item 4; mamba-ssm and flash-linear-attention
// both shipped silent int32 overflows at long T): one layer's forward over a window
// whose [T, P] buffers hold more than 2^31 values equals the same layer run as two
// token blocks (each below 2^31, the state carried between them). About 60 GB: it
// runs where the default memory space has that much (an 80 GB GPU) and is skipped
// elsewhere, saying so.
#include "ash/kernels/rms_norm.hpp"
#include "test_helpers.hpp"

namespace ash::test {

namespace {  // kernels outside the TEST body: nvcc refuses extended lambdas in its private member

void fill_input(const View2<float>& y) {  // a smooth, token-dependent input of unit size
  const index_t P = y.extent(1);
  Kokkos::parallel_for(
      "fill", Range(0, index_t(y.extent(0)) * P), KOKKOS_LAMBDA(const index_t i) {
        const index_t m = i / P, p = i % P;
        y(m, p) = float(kmath::sin(0.0137 * double(m % 100003) + 0.71 * double(p)));
      });
}

// max over rows [from, rows) of |a - b| (b empty: of |a|)
double max_abs(const View2<float>& a, const View2<float>& b, index_t from) {
  const index_t P = a.extent(1), rows = a.extent(0);
  const bool diff = b.extent(0) > 0;
  double r = 0;
  Kokkos::parallel_reduce(
      "max_abs", Range(from * P, rows * P),
      KOKKOS_LAMBDA(const index_t i, double& v) {
        const index_t m = i / P, p = i % P;
        const double x = kmath::fabs(double(a(m, p)) - (diff ? double(b(m, p)) : 0.0));
        v = x > v ? x : v;
      },
      Kokkos::Max<double>(r));
  return r;
}

// One layer's forward over a window of T tokens, whole and as two blocks with
// the state carried: max |whole - blocks| <= 1e-4 max |y|, and the rows from
// `tail_from` on were written.
void expect_two_blocks_equal_the_whole(const ModelDims& d, index_t T, index_t tail_from) {
  const index_t P = d.width, N = d.state;
  const auto model = random_model<float>(d, 31);
  const auto layer = model.layer(0);
  View2<float> y_in(Kokkos::view_alloc(std::string("y_in"), Kokkos::WithoutInitializing), T, P);
  fill_input(y_in);
  View2<float> whole("y_whole", T, P), blocks("y_blocks", T, P);
  {
    const LayerActivations<float> act(SeqShape{1, T, DocStarts()}, d, LayerActivations<float>::projections_only);
    ssm_layer_forward(layer, SeqShape{1, T, DocStarts()}, y_in, act, whole);
  }
  {
    const index_t Tb = T / 2;  // a multiple of the chunk length: the same chunks as the whole window
    const LayerActivations<float> act(SeqShape{1, Tb, DocStarts()}, d, LayerActivations<float>::projections_only);
    View2<float> h("h", P, N);  // the state carried from the first block to the second
    for (index_t j = 0; j < 2; ++j) {
      const auto rows = Kokkos::make_pair(j * Tb, (j + 1) * Tb);
      ssm_layer_forward(layer, SeqShape{1, Tb, DocStarts()}, View2<float>(Kokkos::subview(y_in, rows, Kokkos::ALL())),
                        act, View2<float>(Kokkos::subview(blocks, rows, Kokkos::ALL())), h);
    }
  }
  const double diff = max_abs(whole, blocks, 0), mag = max_abs(whole, View2<float>(), 0);
  const double tail = max_abs(whole, View2<float>(), tail_from);
  std::printf("  T = %lld, T*P = %lld: max |whole - blocks| %.3g, max |y| %.3g (rows from %lld: %.3g)\n",
              (long long)T, (long long)(T * P), diff, mag, (long long)tail_from, tail);
  EXPECT_GT(tail, 0.1);  // those rows were written
  EXPECT_LE(diff, 1e-4 * mag);
}

}  // namespace

// The check itself, at a size every backend runs.
TEST(IndexWidth, LayerForwardEqualsItsTwoBlocks) {
  const index_t T = 8192 + 128;
  expect_two_blocks_equal_the_whole(tiny_dims(1, 17, 64, 16), T, T / 2);
}

TEST(IndexWidth, LayerForwardPast2To31ElementsEqualsItsTwoBlocks) {
  const ModelDims d = tiny_dims(1, 17, 64, 16);
  const index_t P = d.width, N = d.state;
  const index_t T = (index_t(1) << 25) + 2048;  // T·P = 2^31 + 131072 values per [T, P] buffer
  // y_in, both outputs, the whole window's projections [T, 2P + 2N], the blocks' [T/2, 2P + 2N]
  const double need = 4.0 * double(T) * double(3 * P + 3 * (P + N));
  const auto cap = memory_space_capacity();
  if (double(cap.bytes) < 1.15 * need)
    GTEST_SKIP() << "needs about " << format_bytes(std::uint64_t(1.15 * need)) << " of " << MemSpace::name()
                 << " memory (" << cap.what << ": " << format_bytes(cap.bytes) << "); runs on an 80 GB GPU";
  ASSERT_GT(T * P, (index_t(1) << 31));
  expect_two_blocks_equal_the_whole(d, T, (index_t(1) << 31) / P);  // the rows past 2^31 values
}

}  // namespace ash::test

namespace ash::test {

// A team league is an int (Kokkos): a kernel launched over more rows than that
// is refused by name before it starts, not run over a wrapped count. The rows
// here are never touched (views of no columns, or of no memory).
TEST(IndexWidth, TeamLeaguesPast2To31AreRefused) {
  const index_t big = index_t(1) << 31;
  EXPECT_EQ(impl::league_size(big - 1), 0x7fffffff);
  expect_error([&] { (void)impl::league_size(big); }, "team league of 2147483648 teams is past 2^31 - 1");
  const View2<double> x("x", big, 0), yhat("yhat", big, 0);
  const View1<double> w("w", 0);
  const Unmanaged1<double> rstd(nullptr, big);
  expect_error([&] { impl::rms_norm_forward<double>(x, w, rstd, yhat); }, "past 2^31 - 1");
}

}  // namespace ash::test
