// Document boundaries (data.separator, docs/design.md §1): the state restarts
// at a document's first token, which is nobody's target. Checked against the
// per-document identity (a window of whole documents d1..dm has the loss and
// gradient Σ n_i (L_i, ∇L_i) / Σ n_i of each document run alone as its own
// window, n_i = len(d_i) − 1) for every engine and mode, against finite
// differences, and at the data layer (separators, packing).
#include <filesystem>
#include <fstream>
#include <numeric>

#include "test_helpers.hpp"

namespace ash::test {

namespace {

// A batch of windows, each a list of document lengths (summing to T).
using Layout = std::vector<std::vector<index_t>>;

// Documents of length 1, 2 and longer than the chunk (4 below); a start at the
// window's first token and a one-token document at its last.
const Layout two_windows = {{1, 2, 13, 5, 1, 9, 1}, {6, 2, 3, 11, 4, 6}};

struct Packed {
  TokenView x;                                  // [Bt, T], document starts marked
  std::vector<std::vector<std::uint32_t>> docs;  // every document's ids
};

Packed packed_windows(const Layout& layout, index_t V, std::uint64_t seed) {
  const index_t T = std::accumulate(layout[0].begin(), layout[0].end(), index_t(0));
  const index_t Bt = index_t(layout.size());
  const auto ids = random_token_ids(Bt * T, V, seed);
  Packed p;
  p.x = make_windows(ids, Bt, T, V);
  std::vector<index_t> starts;
  for (index_t b = 0; b < Bt; ++b) {
    index_t t = 0;
    for (const index_t len : layout[std::size_t(b)]) {
      starts.push_back(b * T + t);
      p.docs.emplace_back(ids.begin() + b * T + t, ids.begin() + b * T + t + len);
      t += len;
    }
    EXPECT_EQ(t, T) << "test layout: every window must hold T tokens";
  }
  Kokkos::View<index_t*, MemSpace> sv("starts", starts.size());
  auto h = Kokkos::create_mirror_view(sv);
  for (std::size_t i = 0; i < starts.size(); ++i) h(i) = starts[i];
  Kokkos::deep_copy(sv, h);
  set_document_starts(p.x, sv);
  return p;
}

// Σ n_i (L_i, ∇L_i) / Σ n_i over the documents, each its own window.
template <class S>
std::vector<double> per_document(const EngineOptions& o, const ParamSet<S>& ps, const Packed& p, index_t V,
                                 double* loss) {
  std::vector<double> sum(to_host(ps).size(), 0.0);
  double lsum = 0, n = 0;
  for (const auto& doc : p.docs) {
    const index_t len = index_t(doc.size());
    if (len < 2) continue;  // no target
    double l = 0;
    const auto g = grad_of(o, ps, make_windows(doc, 1, len, V), &l);
    for (std::size_t i = 0; i < g.size(); ++i) sum[i] += double(len - 1) * g[i];
    lsum += double(len - 1) * l;
    n += double(len - 1);
  }
  for (auto& v : sum) v /= n;
  *loss = lsum / n;
  return sum;
}

EngineOptions opts(Method m, index_t Tbar = 0, bool detach = false) {
  EngineOptions o;
  o.method = m;
  o.truncate = Tbar;
  o.detach_inputs = detach;
  o.chunk = 4;
  o.wave = 8;
  return o;
}

EngineOptions blockwise(Storage st, index_t m, index_t block, bool detach = false) {
  EngineOptions o = opts(Method::adjoint_exact, 0, detach);
  o.storage = st;
  o.layer_checkpoint = m;
  o.token_block = block;
  return o;
}

struct Case {
  std::string name;
  EngineOptions o;
};

std::vector<Case> every_engine() {
  std::vector<Case> c = {
      {"E1 backprop", opts(Method::backprop)},
      {"E2 adjoint", opts(Method::adjoint)},
      {"E2 adjoint T-bar=3", opts(Method::adjoint, 3)},
      {"E3 exact", opts(Method::adjoint_exact)},
      {"E3 detached", opts(Method::adjoint_exact, 0, true)},
      {"E3 detached T-bar=3", opts(Method::adjoint_exact, 3, true)},
      {"E3 token blocks of 8", blockwise(Storage::full, 1, 8)},
      {"E3 token blocks, layer checkpoint 2, detached", blockwise(Storage::full, 2, 8, true)},
      {"E3 bf16 storage, layer checkpoint 2", blockwise(Storage::bf16, 2, 12)},
  };
  for (const E3Form f : e3_forms())  // every form of E3 (the default one is above)
    if (f != default_e3_form()) c.push_back({"E3 exact, " + e3_form_name(f), with_e3_form(opts(Method::adjoint_exact), f)});
  return c;
}

}  // namespace

template <class S>
class Documents : public ::testing::Test {};
TYPED_TEST_SUITE(Documents, Scalars);

TYPED_TEST(Documents, WindowOfWholeDocumentsEqualsEachDocumentAlone) {
  using S = TypeParam;
  const auto d = tiny_dims(3);
  const auto ps = cast_model<S>(random_model<double>(d, 11));
  const Packed p = packed_windows(two_windows, d.vocab, 5);
  const double tol = std::is_same<S, double>::value ? 1e-11 : 2e-4;
  for (const auto& c : every_engine()) {
    SCOPED_TRACE(c.name);
    double loss = 0, ref_loss = 0;
    const auto g = grad_of(c.o, ps, p.x, &loss);
    const auto ref = per_document(c.o, ps, p, d.vocab, &ref_loss);
    EXPECT_NEAR(loss, ref_loss, (c.o.storage == Storage::bf16 ? 2e-3 : tol) * std::fabs(ref_loss));
    expect_close(g, ref, d, c.o.storage == Storage::bf16 ? 2e-3 : tol, c.name);
  }
}

TYPED_TEST(Documents, BoundariesChangeTheResult) {
  using S = TypeParam;
  const auto d = tiny_dims(2);
  const auto ps = cast_model<S>(random_model<double>(d, 3));
  const Packed p = packed_windows(two_windows, d.vocab, 8);
  TokenView bare("bare", p.x.extent(0), p.x.extent(1));
  Kokkos::deep_copy(bare, p.x);
  set_document_starts(bare, Kokkos::View<index_t*, MemSpace>("none", 0));  // clears every start
  EXPECT_TRUE(document_starts(bare).empty());
  EXPECT_EQ(document_starts(p.x).size(), 13u);
  EXPECT_EQ(target_count(bare), 2 * 31);  // T = 32
  EXPECT_EQ(target_count(p.x), 2 * 31 - 11);  // the starts after t = 0 (two of the 13 are at t = 0)
  double l0 = 0, l1 = 0;
  const auto g0 = grad_of(opts(Method::adjoint_exact), ps, bare, &l0);
  const auto g1 = grad_of(opts(Method::adjoint_exact), ps, p.x, &l1);
  EXPECT_GT(std::fabs(l0 - l1), 1e-3);
  EXPECT_GT(rel_l2(g0, g1), 1e-2);
}

// Finite differences of the forward (an independent path: no reverse mode) on
// a window with document starts, against the exact adjoint.
TEST(Documents, ExactGradientMatchesFiniteDifferences) {
  const auto d = tiny_dims(2, 11, 6, 4);
  const auto ps = random_model<double>(d, 21);
  const Packed p = packed_windows({{3, 1, 7, 2, 5}}, d.vocab, 4);
  double loss = 0;
  const auto g = grad_of(opts(Method::adjoint_exact), ps, p.x, &loss);
  EXPECT_NEAR(loss, forward_loss(ps, p.x), 1e-12);
  const auto fd = finite_difference(ps, [&](const ParamSet<double>& q) { return forward_loss(q, p.x); }, 1e-5);
  for (const auto& t : param_layout(d)) EXPECT_LE(rel_l2(g, fd, t.offset, t.size()), 1e-6) << t.name;
}

// A carried state stops at a document start at the window's first token (the
// result equals starting from zero) and the state left after the window is
// the last document's own.
TEST(Documents, CarriedStateResetsAtADocumentStart) {
  const auto d = tiny_dims(2);
  const auto ps = random_model<double>(d, 9);
  const Packed p = packed_windows({{4, 9, 7}}, d.vocab, 12);  // starts at t = 0, 4, 13
  std::mt19937_64 gen(3);
  std::uniform_real_distribution<double> u(-1, 1);
  std::vector<View2<double>> state;
  for (int k = 0; k < d.layers; ++k) {
    state.emplace_back("h0", d.width, d.state);
    auto h = Kokkos::create_mirror_view(state.back());
    for (index_t i = 0; i < d.width; ++i)
      for (index_t n = 0; n < d.state; ++n) h(i, n) = u(gen);
    Kokkos::deep_copy(state.back(), h);
  }
  auto eng = make_engine<double>(blockwise(Storage::full, 1, 8));
  eng->set_carried_state(&state);
  ParamSet<double> g(d);
  const double loss = eng->compute(ps, p.x, g);
  double l0 = 0;
  const auto g0 = grad_of(blockwise(Storage::full, 1, 8), ps, p.x, &l0);  // from h = 0
  EXPECT_NEAR(loss, l0, 1e-13);
  expect_close(to_host(g), g0, d, 1e-12, "carried into a document start");
  // The state after the window: the last document (7 tokens) alone.
  std::vector<View2<double>> alone;
  for (int k = 0; k < d.layers; ++k) alone.emplace_back("h", d.width, d.state);
  const auto last = make_windows(p.docs.back(), 1, 7, d.vocab);
  forward_loss(ps, last, 1024, alone, last, 0);
  for (int k = 0; k < d.layers; ++k) {
    auto a = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), state[k]);
    auto b = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), alone[k]);
    for (index_t i = 0; i < d.width; ++i)
      for (index_t n = 0; n < d.state; ++n) EXPECT_NEAR(a(i, n), b(i, n), 1e-13);
  }
}

TEST(Documents, StartsAreCheckedAndRoundTrip) {
  TokenView x = make_windows(random_token_ids(12, 5, 1), 2, 6, 5);
  Kokkos::View<index_t*, MemSpace> bad("bad", 1);
  Kokkos::deep_copy(bad, index_t(13));
  expect_error([&] { set_document_starts(x, bad); }, "outside the 2 x 6 tokens");
  Kokkos::View<index_t*, MemSpace> ok("ok", 4);
  auto h = Kokkos::create_mirror_view(ok);
  h(0) = 7;
  h(1) = 0;
  h(2) = 7;   // a duplicate
  h(3) = 12;  // cu_seqlens' closing offset: marks nothing
  Kokkos::deep_copy(ok, h);
  set_document_starts(x, ok);
  EXPECT_EQ(document_starts(x), (std::vector<index_t>{0, 7}));
  EXPECT_EQ(target_count(x), 2 * 5 - 1);
}

// data.separator on a token stream: a document starts after the separator's
// last byte, also when the separator is split across two windows.
TEST(Documents, SeparatorMarksTheTokenAfterIt) {
  const std::string text = "ab%\ncd%\n%\nef%";
  std::vector<std::uint32_t> ids(text.begin(), text.end());
  std::vector<std::uint8_t> f;
  separator_starts(ids, separator_tokens("%\n"), f);
  std::vector<std::size_t> at;
  for (std::size_t i = 0; i < f.size(); ++i)
    if (f[i]) at.push_back(i);
  EXPECT_EQ(at, (std::vector<std::size_t>{4, 8, 10}));  // 'c', the empty document's '%', 'e'
  separator_starts(ids, separator_tokens("zz"), f);       // never occurs: nothing marked
  EXPECT_EQ(std::accumulate(f.begin(), f.end(), 0), 0);
  // Windows of 3 from the dataset: "ab%" "\ncd" "%\n%" "\nef": the separator
  // of the first document is split across windows 0 and 1; 'c' starts one.
  TokenDataset ds(ids, 256, 3, 0.0, 1, true);
  ds.set_documents(separator_tokens("%\n"), false);
  EXPECT_EQ(ds.documents(), 4);
  std::int64_t cursor = 0;
  const auto x = ds.train_batch(0, 4, &cursor);
  EXPECT_EQ(document_starts(x), (std::vector<index_t>{4, 8, 10}));
  expect_error([&] { ds.set_documents(separator_tokens("%\n%\n"), false); }, "longer than a window");
}

TEST(Documents, PackingPlacesWholeDocuments) {
  // Documents (separator "|"): lengths 3, 5, 2, 9, 4, 1, 6, ... from a seeded generator.
  std::mt19937_64 gen(17);
  std::vector<std::uint32_t> ids;
  std::vector<std::vector<std::uint32_t>> docs;
  for (int i = 0; i < 60; ++i) {
    const int len = 1 + int(gen() % 12);  // up to 12 with the separator: some longer than T = 8
    std::vector<std::uint32_t> doc;
    for (int j = 0; j + 1 < len; ++j) doc.push_back(std::uint32_t('a' + gen() % 20));
    doc.push_back('|');
    docs.push_back(doc);
    ids.insert(ids.end(), doc.begin(), doc.end());
  }
  const index_t T = 8;
  TokenDataset ds(ids, 256, T, 0.0, 3, true);
  ds.set_documents(separator_tokens("|"), true);
  const auto& tok = ds.tokens();
  ASSERT_EQ(index_t(tok.size()) % T, 0);
  const index_t nw = ds.train_tokens() / T;
  std::int64_t cursor = 0;
  const auto x = ds.train_batch(0, nw, &cursor);
  auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), x);
  // Read the windows back into documents: real tokens in order equal the file;
  // a document is never split unless longer than T.
  std::vector<std::uint32_t> real;
  std::size_t doc = 0, in_doc = 0;
  for (index_t w = 0; w < nw; ++w)
    for (index_t t = 0; t < T; ++t) {
      const token_t v = h(w, t);
      if (doc < docs.size() && in_doc == docs[doc].size()) {
        ++doc;
        in_doc = 0;
      }
      if (token_id(v) == 0) {  // padding: every token a document start
        EXPECT_TRUE(starts_document(v));
        continue;
      }
      ASSERT_LT(doc, docs.size());
      if (in_doc == 0) {
        EXPECT_TRUE(starts_document(v)) << "window " << w << " token " << t;
        if (docs[doc].size() <= std::size_t(T)) EXPECT_LE(t + index_t(docs[doc].size()), T) << "document split";
      } else {
        EXPECT_FALSE(starts_document(v)) << "window " << w << " token " << t;
      }
      EXPECT_EQ(std::uint32_t(token_id(v)), docs[doc][in_doc]);
      real.push_back(std::uint32_t(token_id(v)));
      ++in_doc;
    }
  EXPECT_EQ(real, ids);
  EXPECT_NEAR(ds.pack_fill(), double(ids.size()) / double(nw * T), 1e-15);
  EXPECT_LT(ds.pack_fill(), 1.0);
  // Random windows are whole packed windows, the same for a seed.
  const auto off = ds.train_offsets(5, 16, 0);
  for (const index_t o : off) EXPECT_EQ(o % T, 0);
  EXPECT_EQ(off, ds.train_offsets(5, 16, 0));
  expect_error([&] { ds.check_cursor(3, 1); }, "packed training tokens");
}

// data.separator's value: a JSON string with escapes, quoted or bare on --set.
TEST(Documents, SeparatorConfigKey) {
  Config c;
  EXPECT_EQ(c.settings().data.separator, "");
  c.set("data.separator=\"\\n%\\n\"");
  EXPECT_EQ(c.settings().data.separator, "\n%\n");
  c.set("data.separator=\\n%\\n");  // bare: the same escapes
  EXPECT_EQ(c.settings().data.separator, "\n%\n");
  c.set("data.separator=\\u0000|");
  EXPECT_EQ(c.settings().data.separator, std::string("\0|", 2));
  EXPECT_EQ(separator_tokens(c.settings().data.separator), (std::vector<std::uint32_t>{0, '|'}));
  expect_error([&] { c.set("data.separator=\"\\q\""); }, "--set data.separator is not valid JSON");
  expect_error([&] { c.set("data.separator=a\\qb"); }, "--set data.separator is not valid JSON");
  expect_error([&] { c.set("data.separator=7"); }, "config key 'data.separator' expects a string");
  Config p;
  p.set("data.pack=true");
  expect_error([&] { p.settings(); }, "data.pack needs data.separator");
}

// Packed training with a carried state and the memory levers resumes bitwise
// (the cursor indexes the packed windows), and its losses differ from the
// same run without documents.
TEST(Documents, PackedTrainingResumesBitwise) {
  const auto corpus = tmp_path("docs.txt");
  {
    std::mt19937_64 gen(8);
    std::string t;
    while (t.size() < 20000) {
      const int len = 1 + int(gen() % 50);
      for (int j = 0; j < len; ++j) t += char('a' + gen() % 8);
      t += "\n%\n";
    }
    std::ofstream(corpus, std::ios::binary) << t;
  }
  auto cfg = [&](const std::string& dir, bool docs) {
    Config c;
    for (const auto& kv : {"model.width=8", "model.state=4", "model.layers=3", "data.seq_len=32", "data.batch=2",
                           "data.sequential=true", "data.carry_state=true", "run.storage=bf16",
                           "grad.layer_checkpoint=2", "grad.token_block=16", "grad.engine=adjoint-exact",
                           "grad.chunk=8", "optim.steps=6", "optim.warmup=2", "run.log_every=1",
                           "run.eval_every=3", "run.ckpt_every=3"})
      c.set(kv);
    if (docs) {
      c.set("data.separator=\\n%\\n");
      c.set("data.pack=true");
    }
    c.set("data.train=" + corpus);
    c.set("run.out_dir=" + dir);
    return c;
  };
  const auto a = tmp_path("straight"), b = tmp_path("split"), n = tmp_path("nodocs");
  for (const auto& p : {a, b, n}) std::filesystem::remove_all(p);
  train(cfg(a, true), "", nullptr);
  train(cfg(b, true), "", nullptr, 3);
  train(cfg(b, true), b + "/checkpoint.h5", nullptr);
  train(cfg(n, false), "", nullptr);
  auto losses = [](const std::string& f) {
    std::vector<double> out;
    std::ifstream in(f);
    for (std::string line; std::getline(in, line);) out.push_back(nlohmann::json::parse(line)["loss"].get<double>());
    return out;
  };
  const auto la = losses(a + "/metrics.jsonl"), lb = losses(b + "/metrics.jsonl"), ln = losses(n + "/metrics.jsonl");
  ASSERT_EQ(la.size(), 6u);
  EXPECT_EQ(la, lb);
  EXPECT_EQ(to_host(load_checkpoint<float>(a + "/checkpoint.h5")), to_host(load_checkpoint<float>(b + "/checkpoint.h5")));
  EXPECT_NE(la, ln);
}

}  // namespace ash::test
