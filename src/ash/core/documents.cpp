#include "ash/core/documents.hpp"

#include "ash/core/error.hpp"

namespace ash {

DocStarts DocStarts::of(const TokenView& x) {
  const index_t T = x.extent(1), M = index_t(x.extent(0)) * T;
  if (M == 0) return DocStarts();
  index_t starts = 0;
  Kokkos::parallel_reduce(
      "ash::docs::any_start", Range(0, M),
      KOKKOS_LAMBDA(const index_t m, index_t& acc) { acc += starts_document(x(m / T, m % T)) ? 1 : 0; }, starts);
  return starts > 0 ? DocStarts(x) : DocStarts();
}

void set_document_starts(const TokenView& x, const Kokkos::View<const index_t*, MemSpace>& starts) {
  const index_t Bt = x.extent(0), T = x.extent(1), M = Bt * T, n = starts.extent(0);
  index_t bad = 0;
  Kokkos::parallel_reduce(
      "ash::docs::check_starts", Range(0, n),
      KOKKOS_LAMBDA(const index_t i, index_t& acc) { acc += (starts(i) < 0 || starts(i) > M) ? 1 : 0; }, bad);
  require(bad == 0, "document starts: " + std::to_string(bad) + " offset(s) outside the " + std::to_string(Bt) +
                        " x " + std::to_string(T) + " tokens of the windows");
  Kokkos::parallel_for(
      "ash::docs::clear_starts", Range(0, M), KOKKOS_LAMBDA(const index_t m) {
        x(m / T, m % T) = token_id(x(m / T, m % T));
      });
  // Each offset sets one bit; duplicates write the same value.
  Kokkos::parallel_for(
      "ash::docs::set_starts", Range(0, n), KOKKOS_LAMBDA(const index_t i) {
        const index_t m = starts(i);
        if (m < M) x(m / T, m % T) = x(m / T, m % T) | doc_start_bit;  // M: cu_seqlens' closing offset
      });
  Kokkos::fence();
}

std::vector<index_t> document_starts(const TokenView& x) {
  auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), x);
  const index_t Bt = x.extent(0), T = x.extent(1);
  std::vector<index_t> out;
  for (index_t b = 0; b < Bt; ++b)
    for (index_t t = 0; t < T; ++t)
      if (starts_document(h(b, t))) out.push_back(b * T + t);
  return out;
}

index_t target_count(const TokenView& x) {
  const index_t Bt = x.extent(0), T = x.extent(1);
  if (T < 2) return 0;
  index_t count = 0;
  Kokkos::parallel_reduce(
      "ash::docs::target_count", Range(0, Bt * (T - 1)),
      KOKKOS_LAMBDA(const index_t i, index_t& acc) {
        const index_t b = i / (T - 1), t = i % (T - 1) + 1;
        acc += starts_document(x(b, t)) ? 0 : 1;
      },
      count);
  return count;
}

void separator_starts(const std::vector<std::uint32_t>& tokens, const std::vector<std::uint32_t>& sep,
                      std::vector<std::uint8_t>& flags) {
  flags.assign(tokens.size(), 0);
  const std::size_t L = sep.size();
  if (L == 0) return;
  for (std::size_t i = L; i < tokens.size(); ++i) {  // token i follows tokens [i-L, i)
    bool match = true;
    for (std::size_t j = 0; j < L && match; ++j) match = tokens[i - L + j] == sep[j];
    flags[i] = match ? 1 : 0;
  }
}

void check_separator(std::size_t separator_bytes, std::int64_t T, bool pack) {
  require(std::int64_t(separator_bytes) <= T,
          "data.separator is " + std::to_string(separator_bytes) + " bytes, longer than a window (data.seq_len = " +
              std::to_string(T) + "): no window could hold a document boundary");
  require(!pack || separator_bytes > 0, "data.pack needs data.separator: packing places whole documents");
}

std::vector<std::uint32_t> separator_tokens(const std::string& sep) {
  std::vector<std::uint32_t> out;
  out.reserve(sep.size());
  for (const char c : sep) out.push_back(std::uint32_t(static_cast<unsigned char>(c)));
  return out;
}

}  // namespace ash
