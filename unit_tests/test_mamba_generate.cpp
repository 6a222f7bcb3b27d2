// Recurrent generation on a Mamba (the Generator) against the full forward.
#include <algorithm>

#include "test_helpers.hpp"

namespace ash::test {


// Recurrent generation (docs/design.md §1, "The recurrent step"): the Generator's
// logits after each token equal the full forward's at that position, fed one token
// at a time and in pieces of 2, 5 and 3 tokens (pieces shorter than Kc - 1 read the
// conv state's older columns), with documents starting at a piece's first token,
// inside one, and one token before a piece ends (the conv state keeps only the new
// document's tokens).
TEST(Mamba, GeneratorStepMatchesFullForward) {
  struct Case {
    std::int64_t Kc;
    bool tied, docs;
    Arch arch = Arch::mamba;
  };
  for (const auto c : {Case{4, true, false}, Case{4, false, true}, Case{3, true, true}, Case{1, false, true},
                       Case{4, false, true, Arch::falcon_mamba}}) {
    const auto d = mamba_tiny_dims(2, c.tied, c.Kc, 2, c.arch);
    auto ps = random_model<double>(d, 11 + c.Kc);
    const index_t T = 23;
    const auto ids = random_token_ids(T, d.vocab, 12);
    std::vector<std::uint8_t> flags(T, 0);
    std::vector<index_t> starts;
    if (c.docs)
      for (index_t t : {index_t(7), index_t(11), index_t(15), index_t(16)}) {
        flags[std::size_t(t)] = 1;
        starts.push_back(t);
      }
    const auto ref = full_logits(ps, with_document_starts(make_windows(ids, 1, T, d.vocab), starts));
    for (const auto& pieces : {std::vector<index_t>(T, 1), std::vector<index_t>{2, 5, 3, 1, 2, 4, 1, 5}}) {
      Generator<double> gen(ps);
      index_t t0 = 0;
      double worst = 0, scale = 0;
      for (const index_t n : pieces) {
        const std::vector<std::uint32_t> tok(ids.begin() + t0, ids.begin() + t0 + n);
        const std::vector<std::uint8_t> fl(flags.begin() + t0, flags.begin() + t0 + n);
        gen.feed(tok, &fl);
        t0 += n;
        for (index_t v = 0; v < d.vocab; ++v) {  // the logits after the piece's last token
          worst = std::max(worst, std::fabs(gen.logits()[v] - ref[t0 - 1][v]));
          scale = std::max(scale, std::fabs(ref[t0 - 1][v]));
        }
      }
      ASSERT_EQ(t0, T);
      EXPECT_GT(scale, 0.1);
      EXPECT_LE(worst, 1e-12 * scale) << arch_name(c.arch) << ", Kc " << c.Kc << (c.docs ? " with documents" : "")
                                      << ", " << pieces.size() << " pieces";
    }
  }
  // Greedy sampling feeds the argmax back: the same as the full forward over the
  // sequence so far.
  const auto d = mamba_tiny_dims(2, true, 4);
  auto ps = random_model<double>(d, 21);
  std::vector<std::uint32_t> seq{3, 1, 4, 1, 5};
  Generator<double> gen(ps);
  gen.feed(seq);
  std::mt19937_64 rng(1);
  for (int i = 0; i < 6; ++i) {
    const auto ref = full_logits(ps, make_windows(seq, 1, index_t(seq.size()), d.vocab)).back();
    const auto best = std::uint32_t(std::max_element(ref.begin(), ref.end()) - ref.begin());
    EXPECT_EQ(gen.sample(0.0, rng), best);
    seq.push_back(best);
  }
}

}  // namespace ash::test
