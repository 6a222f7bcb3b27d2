// JSON configuration: canonical keys, --set overrides, errors that name the key.
#include <chrono>
#include <cstdio>
#include <fstream>

#include "test_helpers.hpp"

namespace ash::test {

namespace {
std::string what_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}
}  // namespace

// An error quotes what it was given (a name read from a hostile file) as valid
// UTF-8: bytes outside a valid sequence and control characters but newline and
// tab become \xNN; valid multi-byte characters stay.
TEST(Error, MessagesAreValidUtf8) {
  const std::string got = Error(std::string("object 'a\xff\xfe' T\xcc\x84 \x01\x7f \xe2\x82 \xed\xa0\x80 ok\n")).what();
  EXPECT_EQ(got, "object 'a\\xff\\xfe' T\xcc\x84 \\x01\\x7f \\xe2\\x82 \\xed\\xa0\\x80 ok\n");
  EXPECT_EQ(std::string(Error("plain").what()), "plain");
}

TEST(Config, DefaultsAreValid) {
  Config c;
  EXPECT_NO_THROW(c.validate());
  EXPECT_EQ(c.model().vocab, 256);
  EXPECT_EQ(c.settings().grad.method, Method::backprop);
}

TEST(Config, SetParsesValues) {
  Config c;
  c.set("model.width=32");
  c.set("grad.engine=adjoint-exact");
  c.set("grad.detach_inputs=true");
  c.set("optim.lr=1e-4");
  c.set("optim.lr=1");  // an integer is fine for a float key
  EXPECT_EQ(c.model().width, 32);
  EXPECT_EQ(c.settings().grad.method, Method::adjoint_exact);
  EXPECT_TRUE(c.settings().grad.detach_inputs);
  EXPECT_EQ(c.settings().optim.lr, 1.0);
}

TEST(Config, UnknownKeysAndWrongTypesNameTheKey) {
  Config c;
  EXPECT_NE(what_of([&] { c.set("model.widht=3"); }).find("unknown config key 'model.widht'"), std::string::npos);
  EXPECT_NE(what_of([&] { c.set("nothing=3"); }).find("unknown config key 'nothing'"), std::string::npos);
  EXPECT_NE(what_of([&] { c.set("model.layers=2.5"); }).find("'model.layers'"), std::string::npos);
  EXPECT_NE(what_of([&] { c.set("model=3"); }).find("'model'"), std::string::npos);
  EXPECT_NE(what_of([&] { c.set("noequals"); }).find("key=value"), std::string::npos);
  EXPECT_NE(what_of([&] { c.merge(nlohmann::json::parse(R"({"data": {"seq_len": 8, "bogus": 1}})"), "f.json"); })
                .find("unknown config key 'data.bogus'"),
            std::string::npos);
  // All-or-nothing: the failed merge did not apply seq_len.
  EXPECT_EQ(c.settings().data.seq_len, Config().settings().data.seq_len);
}

// Found by fuzz/fuzz_config: a value that is not valid UTF-8 made the error
// message itself throw (nlohmann's dump), an internal error instead of exit 2.
TEST(Config, InvalidUtf8IsAClearError) {
  Config c;
  EXPECT_NE(what_of([&] { c.set("data.train=a\xc2" "b"); }).find("is not valid UTF-8"), std::string::npos);
  EXPECT_NE(what_of([&] { c.set("model.width=2\xc2"); }).find("'model.width' expects a number"), std::string::npos);
  EXPECT_NE(what_of([&] { c.merge(nlohmann::json{{"run", {{"out_dir", "r\xff"}}}}, "f.json"); }).find("UTF-8"),
            std::string::npos);
  EXPECT_EQ(c.json().dump(), Config().json().dump()) << "nothing applied";
}

// data.separator names bytes (issue 35): \u0080-\u00ff are the byte values, not
// their UTF-8 encodings; a character above U+00FF is refused, naming the key.
TEST(Config, SeparatorCharactersAreBytes) {
  Config c;
  c.set("data.separator=\\u00dd");  // bare: a JSON string's contents
  EXPECT_EQ(c.settings().data.separator, std::string(1, char(0xDD)));
  c.set(R"(data.separator="%\u0080\u00ff\n")");
  EXPECT_EQ(c.settings().data.separator, std::string("%\x80\xff\n"));
  c.set("data.separator=\xc3\xa9");  // a literal U+00E9 is the byte 0xE9 too
  EXPECT_EQ(c.settings().data.separator, std::string(1, char(0xE9)));
  for (std::uint32_t b = 0; b < 256; ++b) {  // every byte value can be named
    char esc[8];
    std::snprintf(esc, sizeof esc, "\\u%04x", unsigned(b));
    c.set(std::string("data.separator=") + esc);
    ASSERT_EQ(c.settings().data.separator, std::string(1, char(b))) << esc;
  }
  c.set("data.separator=\\u0100");
  EXPECT_NE(what_of([&] { c.settings(); }).find("data.separator holds the character U+0100, which is not a byte"),
            std::string::npos);
  c.set("data.separator=\xe2\x82\xac");  // the euro sign
  EXPECT_NE(what_of([&] { c.settings(); }).find("U+20AC"), std::string::npos);
}

// A dotted --set key is section.name: a long path is refused before it is split
// (60,000 parts took over a minute and passed the nesting limit).
TEST(Config, SetKeysWithManyPartsAreRefusedAtOnce) {
  Config c;
  std::string key = "model";
  for (int i = 0; i < 60000; ++i) key += ".x";
  const auto t0 = std::chrono::steady_clock::now();
  const auto msg = what_of([&] { c.set(key + "=1"); });
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 5.0);
  EXPECT_NE(msg.find("unknown config key (60001 dotted parts"), std::string::npos) << msg.substr(0, 300);
  EXPECT_LT(msg.size(), 400u);
  EXPECT_NE(what_of([&] { c.set("model.width.x=1"); }).find("3 dotted parts"), std::string::npos);
  EXPECT_EQ(c.json().dump(), Config().json().dump()) << "nothing applied";
}

TEST(Config, ValidateRejectsInconsistentSizes) {
  for (const char* bad : {"model.vocab=1", "model.width=0", "model.layers=0", "model.state=0", "data.seq_len=0",
                          "data.seq_len=1", "data.batch=0", "grad.chunk=0", "dist.layer_ranks=5", "dist.data_ranks=-1",
                          "dist.seq_ranks=0", "dist.pipeline_blocks=-1",
                          "grad.engine=sgd"}) {
    Config c;
    c.set(bad);
    EXPECT_THROW(c.validate(), Error) << bad;
  }
}

TEST(Config, FileErrors) {
  Config c;
  EXPECT_NE(what_of([&] { c.merge_file("/nonexistent/cfg.json"); }).find("cannot open"), std::string::npos);
  const auto p = tmp_path("bad.json");
  std::ofstream(p) << "{ not json";
  EXPECT_NE(what_of([&] { c.merge_file(p); }).find("not valid JSON"), std::string::npos);
}

// Nothing after the document but JSON whitespace: nlohmann's lexer ends the input
// at a NUL byte, and skips a byte order mark (Python's json refuses both).
TEST(Config, StrictJsonRefusesWhatFollowsTheDocumentAndAByteOrderMark) {
  const std::string doc = R"({"model": {"width": 8}})";
  EXPECT_EQ(parse_json_strict(doc + " \t\r\n", "t")["model"]["width"], 8);
  const std::string nul("\0", 1);
  EXPECT_NE(what_of([&] { (void)parse_json_strict(doc + nul + "garbage", "t"); }).find("t is not valid JSON: a NUL byte at offset 23"),
            std::string::npos);
  EXPECT_NE(what_of([&] { (void)parse_json_strict(doc + nul, "t"); }).find("a NUL byte"), std::string::npos);
  EXPECT_NE(what_of([&] { (void)parse_json_strict(doc + " x", "t"); }).find("t is not valid JSON"), std::string::npos);
  EXPECT_NE(what_of([&] { (void)parse_json_strict("\xEF\xBB\xBF" + doc, "t"); }).find("byte order mark"),
            std::string::npos);
  // In a string, NUL is written \u0000 and stays a character of it.
  EXPECT_EQ(parse_json_strict(R"({"a": "x\u0000y"})", "t")["a"].get<std::string>(), std::string("x\0y", 3));
  // Through a config file, as --config reads it.
  Config c;
  const auto p = tmp_path("nul.json");
  std::ofstream(p, std::ios::binary) << doc << nul << "{\"model\": {\"width\": 9}}";
  EXPECT_NE(what_of([&] { c.merge_file(p); }).find("a NUL byte"), std::string::npos);
  std::ofstream(p, std::ios::binary) << "\xEF\xBB\xBF" << doc;
  EXPECT_NE(what_of([&] { c.merge_file(p); }).find("byte order mark"), std::string::npos);
  EXPECT_EQ(c.json()["model"]["width"], 64) << "nothing applied";
}

// The document as parse() builds it: every type, nesting, order of keys, and a
// duplicate key refused at any depth.
TEST(Config, StrictJsonBuildsTheDocument) {
  const std::string text =
      R"({"b": [1, -2, 3.5, "s", true, false, null, [], {}, [[{"x": [0]}]]], "a": {"c": {"d": 18446744073709551615}}})";
  EXPECT_EQ(parse_json_strict(text, "t"), nlohmann::json::parse(text));
  EXPECT_EQ(parse_json_strict("[]", "t"), nlohmann::json::array());
  EXPECT_EQ(parse_json_strict("7", "t"), 7);
  EXPECT_NE(what_of([&] { (void)parse_json_strict(R"({"a": [{"k": 1, "k": 2}]})", "t"); }).find("t: duplicate key 'k'"),
            std::string::npos);
  EXPECT_EQ(parse_json_strict(R"({"a": {"k": 1}, "b": {"k": 2}})", "t")["b"]["k"], 2) << "one key in two objects";
}

}  // namespace ash::test
