// The `ash` tool end to end: init -> inspect -> grad, and bad inputs
// (docs/design.md §7): a clear message, a non-zero exit, nothing lost.
#include <hdf5.h>

#include <algorithm>
#include <cstdio>
#include <fstream>

#include "cli_runner.hpp"
#include "test_helpers.hpp"

namespace ash::test {

namespace {

std::string dir() { return tmp_path(""); }

std::string text_corpus() {
  std::string s;
  for (int i = 0; i < 40; ++i) s += "the quick brown fox jumps over the lazy dog; ";
  return s;
}

class Cli : public ::testing::Test {
 protected:
  void SetUp() override {
    ckpt = dir() + "model.h5";
    text = dir() + "corpus.txt";
    write(text, text_corpus());
    auto r = run("init --set model.width=8 --set model.state=4 --set model.layers=2 --set data.seq_len=32 "
                 "--set data.batch=2 --out " + ckpt);
    ASSERT_EQ(r.code, 0) << r.out;
  }
  std::string ckpt, text;
};

}  // namespace

TEST_F(Cli, InitInspectGradMatchTheLibrary) {
  auto ins = run("inspect " + ckpt);
  ASSERT_EQ(ins.code, 0) << ins.out;
  EXPECT_NE(ins.out.find("/params/layers/001/W_B"), std::string::npos);
  EXPECT_NE(ins.out.find("[4, 8]"), std::string::npos);
  EXPECT_NE(ins.out.find("\"seq_len\": 32"), std::string::npos);
  EXPECT_NE(ins.out.find("format_version 3"), std::string::npos);
  EXPECT_NE(ins.out.find("verified: the header digest and every dataset's digest"), std::string::npos) << ins.out;

  const auto out = dir() + "grads.h5";
  auto g = run("grad --checkpoint " + ckpt + " --tokens " + text + " --engine backprop --out " + out);
  ASSERT_EQ(g.code, 0) << g.out;
  EXPECT_NE(g.out.find("loss "), std::string::npos);
  EXPECT_NE(g.out.find("peak"), std::string::npos);

  // Same numbers as the library on the same windows.
  CheckpointInfo info;
  auto ps = load_checkpoint<double>(ckpt, &info);
  const auto x = make_windows(load_tokens(text), 2, 32, info.dims.vocab);
  ParamSet<double> ref(info.dims);
  const double loss = make_engine<double>(EngineOptions{})->compute(ps, x, ref);
  double file_loss = 0;
  const auto got = load_gradients(out, info.dims, &file_loss);
  EXPECT_EQ(file_loss, loss);
  EXPECT_EQ(to_host(got), to_host(ref));

  // The exact adjoint through the tool: same gradient to rounding.
  const auto out3 = dir() + "grads_e3.h5";
  auto g3 = run("grad --checkpoint " + ckpt + " --tokens " + text + " --engine adjoint-exact --chunk 5 --out " + out3);
  ASSERT_EQ(g3.code, 0) << g3.out;
  EXPECT_NE(g3.out.find("adjoint-exact (C=5)"), std::string::npos) << g3.out;
  const auto e3 = to_host(load_gradients(out3, info.dims));
  EXPECT_LE(rel_l2(e3, to_host(ref)), 1e-10);
  // Paper mode: E2 truncated and E3 detached with the same window agree.
  const auto o2 = dir() + "g_e2.h5", o3 = dir() + "g_e3w.h5";
  ASSERT_EQ(run("grad --checkpoint " + ckpt + " --tokens " + text + " --engine adjoint --truncate 6 --out " + o2).code, 0);
  ASSERT_EQ(run("grad --checkpoint " + ckpt + " --tokens " + text +
                " --engine adjoint-exact --detach-inputs --truncate 6 --chunk 4 --out " + o3).code, 0);
  EXPECT_LE(rel_l2(to_host(load_gradients(o3, info.dims)), to_host(load_gradients(o2, info.dims))), 1e-10);
  EXPECT_FAILS_WITH(run("grad --checkpoint " + ckpt + " --tokens " + text +
                        " --engine adjoint-exact --truncate 6 --out " + o3), "needs grad.detach_inputs");
}

// ash eval: the mean loss over every target of the file, windows of T from
// h = 0 and a shorter last window, equals the library's per-window losses
// (E1's forward, another code path) weighted by their target counts.
TEST_F(Cli, EvalMatchesPerWindowLosses) {
  auto e = run("eval --checkpoint " + ckpt + " --tokens " + text + " --set data.seq_len=97 --set data.batch=3");
  ASSERT_EQ(e.code, 0) << e.out;
  const auto at = e.out.find("loss ");
  ASSERT_NE(at, std::string::npos) << e.out;
  const double got = std::stod(e.out.substr(at + 5));
  EXPECT_NE(e.out.find("and one of 54"), std::string::npos) << e.out;  // 1800 tokens: 18 windows of 97 + 54

  CheckpointInfo info;
  auto ps = load_checkpoint<double>(ckpt, &info);
  const auto ids = load_tokens(text);
  const index_t n = index_t(ids.size()), T = 97;
  double nats = 0;
  index_t targets = 0;
  for (index_t first = 0; first + 2 <= n; first += T) {
    const index_t len = std::min(T, n - first);
    ParamSet<double> g(info.dims);
    const double loss =
        make_engine<double>(EngineOptions{})->compute(ps, make_windows(ids, 1, len, info.dims.vocab, first), g);
    nats += loss * double(len - 1);
    targets += len - 1;
  }
  EXPECT_NEAR(got, nats / double(targets), 1e-6 * std::abs(got));  // printed to 7 significant digits
  EXPECT_FAILS_WITH(run("eval --checkpoint " + ckpt + " --tokens " + dir() + "none.txt"), "cannot open token file");
  EXPECT_FAILS_WITH(run("eval --checkpoint " + ckpt + " --tokens " + text + " --set model.width=4"),
                    "may not change the model sizes");
}

// data.separator in ash eval: each document scored from h = 0 without its
// first token, the total equal to the library's per-document sum; bad values
// exit 2 naming the key.
TEST_F(Cli, EvalScoresEachDocument) {
  const auto docs = dir() + "docs.txt";
  std::string t;
  std::mt19937_64 gen(4);
  for (int i = 0; i < 40; ++i) {
    const int len = 1 + int(gen() % 60);
    for (int j = 0; j < len; ++j) t += char('a' + gen() % 26);
    t += "\n%\n";
  }
  write(docs, t);
  auto e = run("eval --checkpoint " + ckpt + " --tokens " + docs + " --set data.seq_len=50 --set 'data.separator=\\n%\\n'");
  ASSERT_EQ(e.code, 0) << e.out;
  EXPECT_NE(e.out.find("40 documents (data.separator)"), std::string::npos) << e.out;  // nothing follows the last separator
  const double got = std::stod(e.out.substr(e.out.find("loss ") + 5));
  CheckpointInfo info;
  auto ps = load_checkpoint<double>(ckpt, &info);
  const auto ids = load_tokens(docs);
  std::vector<std::uint8_t> starts;
  separator_starts(ids, separator_tokens("\n%\n"), starts);
  double nats = 0;
  index_t targets = 0;
  for (index_t first = 0; first + 2 <= index_t(ids.size()); first += 50) {
    const index_t len = std::min<index_t>(50, index_t(ids.size()) - first);
    const auto x = make_windows(ids, 1, len, info.dims.vocab, first, &starts);
    nats += forward_loss(ps, x) * double(target_count(x));
    targets += target_count(x);
  }
  EXPECT_NEAR(got, nats / double(targets), 1e-6 * std::abs(got));
  EXPECT_NE(e.out.find("over " + std::to_string(targets) + " targets"), std::string::npos) << e.out;
  const auto plain = run("eval --checkpoint " + ckpt + " --tokens " + docs + " --set data.seq_len=50");
  const index_t windows = (index_t(ids.size()) + 49) / 50;  // every target but each window's first token
  EXPECT_NE(plain.out.find("over " + std::to_string(index_t(ids.size()) - windows) + " targets"), std::string::npos)
      << plain.out;
  EXPECT_LT(targets, index_t(ids.size()) - windows - 30);  // the documents' first tokens are not scored
  const auto g = "grad --checkpoint " + ckpt + " --tokens " + docs + " --out " + dir() + "g.h5 ";
  auto bad = run(g + "--set 'data.separator=\"\\q\"'");
  EXPECT_EQ(bad.code, 2) << bad.out;
  EXPECT_NE(bad.out.find("data.separator is not valid JSON"), std::string::npos) << bad.out;
  bad = run(g + "--set data.separator=5");
  EXPECT_EQ(bad.code, 2) << bad.out;
  EXPECT_NE(bad.out.find("config key 'data.separator' expects a string"), std::string::npos) << bad.out;
  bad = run(g + "--set data.seq_len=3 --set data.separator=abcd");
  EXPECT_EQ(bad.code, 2) << bad.out;
  EXPECT_NE(bad.out.find("data.separator is 4 bytes, longer than a window"), std::string::npos) << bad.out;
  bad = run(g + "--set data.pack=true");
  EXPECT_EQ(bad.code, 2) << bad.out;
  EXPECT_NE(bad.out.find("data.pack needs data.separator"), std::string::npos) << bad.out;
  bad = run(g + "--set 'data.separator=\\u20ac'");
  EXPECT_EQ(bad.code, 2) << bad.out;
  EXPECT_NE(bad.out.find("data.separator holds the character U+20AC, which is not a byte"), std::string::npos)
      << bad.out;
  // A byte >= 0x80 named as \u00XX separates documents (issue 35: it was matched as its
  // UTF-8 encoding, and 99 separators made one document).
  std::string high;
  for (int i = 0; i < 99; ++i) high += std::string(5 + i % 7, 'a' + char(i % 26)) + char(0xDD);
  write(dir() + "high.txt", high);
  auto h = run("eval --checkpoint " + ckpt + " --tokens " + dir() + "high.txt --set data.seq_len=64 " +
               "--set 'data.separator=\\u00dd'");
  ASSERT_EQ(h.code, 0) << h.out;
  EXPECT_NE(h.out.find("99 documents (data.separator)"), std::string::npos) << h.out;
}

// ash generate reads data.separator as bytes, as every verb does: a model whose
// separator is \u00dd (the byte 0xDD) ends its sample at the first 0xDD drawn (it
// read the raw JSON string, C3 9D, and went on past it).
TEST_F(Cli, GenerateEndsAtAByteSeparator) {
  const auto model = dir() + "sep_dd.h5";
  ASSERT_EQ(run("init --set model.width=8 --set model.state=4 --set 'data.separator=\\u00dd' --out " + model).code, 0);
  const auto r = run("generate --checkpoint " + model + " --prompt ab --tokens 3000 --seed 3 --temperature 1");
  ASSERT_EQ(r.code, 0) << r.out;
  const auto line = r.out.substr(0, r.out.find('\n', 2));
  const auto at = line.find(char(0xDD), 2);
  ASSERT_NE(at, std::string::npos) << "no 0xDD in 3000 draws from a near-uniform model (seed 3)";
  EXPECT_EQ(at + 1, line.size()) << "the sample went on past the separator";
}

TEST_F(Cli, BadConfigs) {
  const auto cfg = dir() + "bad.json";
  write(cfg, R"({"model": {"width": 8, "colour": "red"}})");
  EXPECT_FAILS_WITH(run("init --config " + cfg + " --out " + dir() + "x.h5"), "unknown config key 'model.colour'");
  EXPECT_FAILS_WITH(run("init --set model.bogus=1 --out " + dir() + "x.h5"), "unknown config key 'model.bogus'");
  EXPECT_FAILS_WITH(run("init --set model.width=0 --out " + dir() + "x.h5"), "model.width");
  EXPECT_FAILS_WITH(run("init --set model.layers=two --out " + dir() + "x.h5"), "model.layers");
  write(cfg, "{\"model\": ");
  EXPECT_FAILS_WITH(run("init --config " + cfg + " --out " + dir() + "x.h5"), "not valid JSON");
}

TEST_F(Cli, BadTokensAndSizes) {
  const auto out = dir() + "g.h5";
  const auto g = "grad --checkpoint " + ckpt + " --out " + out + " ";
  EXPECT_FAILS_WITH(run(g + "--tokens " + dir() + "none.txt"), "cannot open token file");
  EXPECT_FAILS_WITH(run(g + "--tokens " + text + " --set data.seq_len=0"), "data.seq_len");
  EXPECT_FAILS_WITH(run(g + "--tokens " + text + " --set data.seq_len=100000"), "tokens");
  EXPECT_FAILS_WITH(run(g + "--tokens " + text + " --set model.width=4"), "may not change the model sizes");
  const auto u16 = dir() + "odd.u16";
  write(u16, "abc");
  EXPECT_FAILS_WITH(run(g + "--tokens " + u16), "truncated");
  // Token ids >= V: a 17-symbol model on text bytes.
  const auto small = dir() + "small.h5";
  ASSERT_EQ(run("init --set model.vocab=17 --set data.seq_len=8 --out " + small).code, 0);
  EXPECT_FAILS_WITH(run("grad --checkpoint " + small + " --tokens " + text + " --out " + out), ">= vocab 17");
  EXPECT_FAILS_WITH(run(g + "--tokens " + text + " --engine sgd"), "grad.engine");
  EXPECT_FAILS_WITH(run(g + "--tokens " + text + " --truncate 4"), "grad.truncate");
  EXPECT_FAILS_WITH(run(g + "--tokens " + text + " --chunk 0"), "grad.chunk");
  EXPECT_NE(run("grad --checkpoint " + ckpt).code, 0);  // missing required options (CLI11)
  EXPECT_FALSE(std::ifstream(out).good()) << "no gradient file after failures";
}

TEST_F(Cli, BadCheckpoints) {
  const auto g = " --tokens " + text + " --out " + dir() + "g.h5";
  EXPECT_FAILS_WITH(run("grad --checkpoint " + dir() + "nope.h5" + g), "cannot open checkpoint");
  EXPECT_FAILS_WITH(run("inspect " + dir() + "nope.h5"), "cannot open checkpoint");
  const auto junk = dir() + "junk.h5";
  write(junk, "garbage that is not HDF5");
  EXPECT_FAILS_WITH(run("grad --checkpoint " + junk + g), "not an HDF5 file");
  // Truncated copy of a good checkpoint.
  const std::string bytes = slurp(ckpt);
  const auto cut = dir() + "cut.h5";
  write(cut, bytes.substr(0, bytes.size() / 3));
  const auto r = run("inspect " + cut);
  EXPECT_NE(r.code, 0);
  EXPECT_EQ(r.out.find("internal error"), std::string::npos) << r.out;
  // Wrong version.
  const auto wrong = dir() + "wrong.h5";
  write(wrong, bytes);
  set_format_version(wrong, 7);
  EXPECT_FAILS_WITH(run("inspect " + wrong), "format version 7");
}

TEST_F(Cli, FailedInitKeepsExistingFile) {
  // A refused init must not touch a good checkpoint at the same path.
  EXPECT_NE(run("init --set model.nope=1 --out " + ckpt).code, 0);
  EXPECT_EQ(run("inspect " + ckpt).code, 0);
}

// The help is ash's own: Kokkos starts after the command line is parsed, with
// only its --kokkos-... arguments, so it prints no banner of its own.
TEST(CliStart, HelpIsAshsOwn) {
  for (const std::string args : {"--help", "grad --help", "plan --help", "-h"}) {
    const auto r = run(args);
    EXPECT_EQ(r.code, 0) << "ash " << args << ":\n" << r.out;
    EXPECT_EQ(r.out.find("Kokkos command line"), std::string::npos) << "ash " << args << ":\n" << r.out;
    EXPECT_EQ(r.out.find("--kokkos-threads"), std::string::npos) << "ash " << args << ":\n" << r.out;
    EXPECT_NE(r.out.find(args.rfind("grad", 0) == 0 ? "--checkpoint" : args.rfind("plan", 0) == 0 ? "--for" : "generate"),
              std::string::npos)
        << "ash " << args << ":\n" << r.out;
  }
}

TEST(CliStart, UnknownVerbIsNamed) {
  for (const std::string args : {"convert", "convert --checkpoint model.h5", "Train --resume x.h5"}) {
    const auto r = run(args);
    const std::string verb = args.substr(0, args.find(' '));
    EXPECT_EQ(r.code, 2) << "ash " << args << ":\n" << r.out;
    EXPECT_EQ(r.out.rfind("ash: error: unknown verb '" + verb + "'", 0), 0u) << r.out;
    EXPECT_EQ(std::count(r.out.begin(), r.out.end(), '\n'), 1) << r.out;
    EXPECT_NE(r.out.find("init, grad, train"), std::string::npos) << "the verbs are listed: " << r.out;
  }
  // Without a verb the parser still says that one is required.
  EXPECT_FAILS_WITH(run(""), "A subcommand is required");
}

// Kokkos' own arguments still reach Kokkos, before or after the verb.
TEST(CliStart, KokkosArgumentsReachKokkos) {
#if KOKKOS_VERSION >= 30700
  const std::string threads = "--kokkos-num-threads=1";
#else
  const std::string threads = "--kokkos-threads=1";  // Kokkos 3.4 knows no --kokkos-num-threads
#endif
  for (const std::string args : {threads + " plan", "plan " + threads, threads + " --kokkos-disable-warnings plan"}) {
    const auto r = run(args);
    EXPECT_EQ(r.code, 0) << "ash " << args << ":\n" << r.out;
    EXPECT_NE(r.out.find("peak"), std::string::npos) << "ash " << args << ":\n" << r.out;
  }
  const auto help = run("--kokkos-help");
  EXPECT_EQ(help.code, 0) << help.out;
  EXPECT_NE(help.out.find("--kokkos-help"), std::string::npos) << "Kokkos' own help: " << help.out;
  // A --kokkos-... argument that Kokkos does not know is a usage error naming it.
  const auto bad = run("--kokkos-no-such-thing=1 plan");
  EXPECT_EQ(bad.code, 2) << bad.out;
  EXPECT_NE(bad.out.find("ash: error: unknown Kokkos argument '--kokkos-no-such-thing=1'"), std::string::npos)
      << bad.out;
  // After "--" a word is ash's, not Kokkos': here a file that does not exist.
  EXPECT_FAILS_WITH(run("inspect -- --kokkos-threads=1.h5"), "--kokkos-threads=1.h5");
}

}  // namespace ash::test
