// The safetensors reader and writer (io/safetensors) and the Hugging Face Mamba
// folder mapping (app/hf_mamba): bitwise round trips in every dtype, the bytes the
// `safetensors` package writes, and hostile files each refused with a message
// naming the problem. The same code against the Python packages themselves:
// unit_tests/test_safetensors_interop.py (ctest safetensors_interop).
#include <sys/stat.h>
#include <unistd.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>

#include "test_helpers.hpp"

namespace ash::test {

namespace {

namespace fs = std::filesystem;

std::string le64(std::uint64_t n) {
  std::string s(8, '\0');
  for (auto& c : s) c = char(n & 0xff), n >>= 8;
  return s;
}

// A file of the format: the header's length, the header as given, the buffer.
std::string raw(const std::string& header, const std::string& buffer = "") { return le64(header.size()) + header + buffer; }

std::string write_file(const std::string& name, const std::string& bytes) {
  const std::string p = tmp_path(name);
  std::ofstream(p, std::ios::binary) << bytes;
  return p;
}

std::string f32_bytes(std::initializer_list<float> v) {
  std::string s;
  for (float x : v) {
    char b[4];
    std::memcpy(b, &x, 4);  // little-endian host (x86-64, aarch64)
    s.append(b, 4);
  }
  return s;
}

// Random values of dtype t whose every bit pattern is kept (no NaN: a signalling
// NaN would be quieted by float arithmetic), including ±0, ±inf and subnormals.
std::vector<double> random_values(TensorDtype t, std::size_t n, std::uint64_t seed) {
  std::mt19937_64 gen(seed);
  std::vector<double> v;
  while (v.size() < n) {
    const std::uint64_t r = gen();
    double d = 0;
    switch (t) {
      case TensorDtype::f64: std::memcpy(&d, &r, 8); break;
      case TensorDtype::f32: d = half::bits_float(std::uint32_t(r)); break;
      case TensorDtype::bf16: d = half::from_bf16(std::uint16_t(r)); break;
      case TensorDtype::f16: d = half::from_fp16(std::uint16_t(r)); break;
    }
    if (!std::isnan(d)) v.push_back(d);
  }
  v[0] = -0.0, v[1] = INFINITY, v[2] = -INFINITY;
  return v;
}

bool same_bits(double a, double b) { return std::memcmp(&a, &b, 8) == 0; }

}  // namespace

TEST(Safetensors, RoundTripBitwiseEveryDtype) {
  const std::string path = tmp_path("rt.safetensors");
  std::vector<std::vector<double>> values;
  std::vector<TensorToWrite> tensors;
  const TensorDtype types[] = {TensorDtype::f64, TensorDtype::f32, TensorDtype::bf16, TensorDtype::f16};
  for (int i = 0; i < 4; ++i) values.push_back(random_values(types[i], 3 * 700, 11 + i));
  for (int i = 0; i < 4; ++i)
    tensors.emplace_back(std::string("t.") + dtype_name(types[i]), types[i], std::vector<std::int64_t>{3, 700}, values[i]);
  std::vector<float> f32(values[1].begin(), values[1].end());
  tensors.emplace_back("from_float", TensorDtype::f32, std::vector<std::int64_t>{3, 700}, f32);
  const std::vector<double> none, scalar{2.5};
  tensors.emplace_back("empty", TensorDtype::f16, std::vector<std::int64_t>{0, 5}, none);
  tensors.emplace_back("scalar", TensorDtype::f64, std::vector<std::int64_t>{}, scalar);
  write_safetensors(path, tensors);

  const SafetensorsReader r(path);
  EXPECT_EQ(r.metadata(), (std::map<std::string, std::string>{{"format", "pt"}}));
  ASSERT_EQ(r.tensors().size(), tensors.size());
  for (int i = 0; i < 4; ++i) {
    const std::string name = std::string("t.") + dtype_name(types[i]);
    EXPECT_EQ(r.at(name).dtype, types[i]);
    EXPECT_EQ(r.at(name).shape, (std::vector<std::int64_t>{3, 700}));
    const auto back = r.read<double>(name);
    ASSERT_EQ(back.size(), values[i].size());
    for (std::size_t j = 0; j < back.size(); ++j) ASSERT_TRUE(same_bits(back[j], values[i][j])) << name << " " << j;
    if (types[i] != TensorDtype::f64) {  // exact in float too
      const auto f = r.read<float>(name);
      for (std::size_t j = 0; j < f.size(); ++j) ASSERT_TRUE(same_bits(double(f[j]), values[i][j])) << name << " " << j;
    }
  }
  const auto ff = r.read<float>("from_float");
  EXPECT_EQ(std::memcmp(ff.data(), f32.data(), f32.size() * 4), 0);
  EXPECT_TRUE(r.read<double>("empty").empty());
  EXPECT_EQ(r.read<double>("scalar"), std::vector<double>{2.5});
  // F64 into float rounds to nearest.
  EXPECT_EQ(r.read<float>("t.F64")[5], float(values[0][5]));
  // Stored bytes are little-endian elements.
  const auto bytes = r.read_bytes("t.F32");
  float first;
  std::memcpy(&first, bytes.data(), 4);
  EXPECT_TRUE(same_bits(double(first), values[1][0]));

  // Written again from what was read: the same file, byte for byte.
  std::vector<std::vector<double>> again;
  std::vector<TensorToWrite> copy;
  for (const auto& e : r.tensors()) again.push_back(r.read<double>(e.name));
  for (std::size_t i = 0; i < again.size(); ++i)
    copy.emplace_back(r.tensors()[i].name, r.tensors()[i].dtype, r.tensors()[i].shape, again[i]);
  const std::string path2 = tmp_path("rt2.safetensors");
  write_safetensors(path2, copy);
  EXPECT_EQ(slurp(path), slurp(path2));
}

// The bytes safetensors 0.8.0 wrote for the same tensors (save_file in Python):
// data by dtype (F64, F32, BF16, F16) then name, keys in data order, "__metadata__"
// first, the header padded with spaces to a multiple of 8.
TEST(Safetensors, WritesTheBytesOfThePythonPackage) {
  const std::string p1 = tmp_path("one.safetensors");
  const std::vector<double> two_ones{1, 1};
  write_safetensors(p1, {TensorToWrite("w", TensorDtype::f32, {2}, two_ones)}, {});
  EXPECT_EQ(slurp(p1), raw(std::string(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})") + "  ",
                           f32_bytes({1, 1})));

  const std::string p2 = tmp_path("mixed.safetensors");
  const std::vector<double> ones3{1, 1, 1}, zeros2{0, 0}, one{1}, none;
  write_safetensors(p2, {TensorToWrite("d", TensorDtype::f16, {1}, one), TensorToWrite("c", TensorDtype::bf16, {1}, one),
                         TensorToWrite("b", TensorDtype::f32, {2}, zeros2), TensorToWrite("aa", TensorDtype::f32, {0}, none),
                         TensorToWrite("a", TensorDtype::f64, {3}, ones3)});
  const std::string header =
      R"({"__metadata__":{"format":"pt"},"a":{"dtype":"F64","shape":[3],"data_offsets":[0,24]},)"
      R"("aa":{"dtype":"F32","shape":[0],"data_offsets":[24,24]},"b":{"dtype":"F32","shape":[2],"data_offsets":[24,32]},)"
      R"("c":{"dtype":"BF16","shape":[1],"data_offsets":[32,34]},"d":{"dtype":"F16","shape":[1],"data_offsets":[34,36]}})"
      "    ";
  std::string data;
  for (int i = 0; i < 3; ++i) data += std::string("\0\0\0\0\0\0\xf0\x3f", 8);
  data += std::string(8, '\0') + std::string("\x80\x3f", 2) + std::string("\x00\x3c", 2);
  EXPECT_EQ(header.size(), 312u);
  EXPECT_EQ(slurp(p2), raw(header, data));
}

TEST(Safetensors, WriterRefusesBadInput) {
  const std::string p = tmp_path("bad.safetensors");
  const std::vector<double> two{1, 2};
  expect_error([&] { write_safetensors(p, {TensorToWrite("x", TensorDtype::f32, {3}, two)}); },
               "tensor \"x\": the shape holds 3 values, 2 were given");
  expect_error([&] {
    write_safetensors(p, {TensorToWrite("x", TensorDtype::f32, {2}, two), TensorToWrite("x", TensorDtype::f64, {2}, two)});
  }, "tensor \"x\" is given twice");
  expect_error([&] { write_safetensors(p, {TensorToWrite("__metadata__", TensorDtype::f32, {2}, two)}); }, "reserved");
  expect_error([&] { write_safetensors(p, {TensorToWrite("", TensorDtype::f32, {2}, two)}); }, "empty name");
  expect_error([&] { write_safetensors(p, {TensorToWrite("\xff", TensorDtype::f32, {2}, two)}); }, "not valid UTF-8");
  expect_error([&] { write_safetensors(p, {TensorToWrite("x", TensorDtype::f32, {-1}, two)}); }, "negative dimension");
  EXPECT_FALSE(fs::exists(p));  // nothing written by a refused call
}

TEST(Safetensors, WriteIsAtomicAndRefusesALink) {
  const std::string victim = write_file("victim", "the victim\n");
  const std::string out = tmp_path("out.safetensors");
  fs::remove(out);
  fs::create_symlink(victim, out);
  const std::vector<double> three{3};
  // A link at the output is refused (docs/cli.md, Output files): neither written through nor replaced.
  expect_error([&] { write_safetensors(out, {TensorToWrite("w", TensorDtype::f32, {1}, three)}); },
               "is a symbolic link");
  EXPECT_TRUE(fs::is_symlink(out));
  EXPECT_EQ(slurp(victim), "the victim\n");
  fs::remove(out);
  write_safetensors(out, {TensorToWrite("w", TensorDtype::f32, {1}, three)});
  EXPECT_FALSE(fs::is_symlink(out));
  EXPECT_EQ(SafetensorsReader(out).read<double>("w"), std::vector<double>{3});
  for (const auto& e : fs::directory_iterator(fs::path(out).parent_path()))  // no temporary file left
    EXPECT_EQ(e.path().filename().string().find(fs::path(out).filename().string() + ".tmp."), std::string::npos);
  expect_error([&] { write_safetensors(tmp_path("no/such/dir/x.safetensors"), {}); }, "cannot create");
}

// Each hostile file refused, the message naming the problem (and the tensor).
TEST(Safetensors, HostileFilesRefused) {
  const std::string ok_header = R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";
  const std::string ok_data = f32_bytes({1, 2});
  ASSERT_EQ(SafetensorsReader(write_file("ok", raw(ok_header, ok_data))).read<double>("w"), (std::vector<double>{1, 2}));
  const std::string full = raw(ok_header, ok_data);
  auto refused = [&](const std::string& label, const std::string& bytes, const std::string& needle) {
    SCOPED_TRACE(label);
    const std::string p = write_file(label, bytes);
    expect_error([&] { SafetensorsReader r(p); }, needle);
  };
  refused("empty", "", "truncated: 0 bytes");
  refused("short", full.substr(0, 5), "truncated: 5 bytes");
  refused("cut_header", full.substr(0, 30), "runs past the end");
  refused("cut_data", full.substr(0, full.size() - 1), "run past the 7-byte data buffer");
  refused("huge_header", le64(std::uint64_t(1) << 40) + "{}", "above the limit of 100000000 bytes");
  refused("header_max", le64(~std::uint64_t(0)) + "{}", "above the limit");
  refused("not_object", raw("[1,2]"), "does not start with '{'");
  refused("bad_json", raw(R"({"w":{"dtype":"F32",)"), "is not valid JSON");
  refused("bad_utf8", raw("{\"\xff\":1}"), "is not valid JSON");
  refused("deep", raw(std::string(100, '{') + std::string(100, '}')), "levels deep");
  refused("duplicate", raw(R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"w":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", ok_data),
          "duplicate key 'w'");
  refused("unknown_dtype", raw(R"({"w":{"dtype":"Q9","shape":[2],"data_offsets":[0,8]}})", ok_data),
          "tensor \"w\": dtype 'Q9' is not read");
  refused("int_dtype", raw(R"({"w":{"dtype":"I64","shape":[1],"data_offsets":[0,8]}})", ok_data),
          "tensor \"w\": dtype 'I64' is not read (only F64, F32, BF16 and F16 are)");
  refused("wrong_size", raw(R"({"w":{"dtype":"F64","shape":[2],"data_offsets":[0,8]}})", ok_data),
          "tensor \"w\": shape × F64 is 16 bytes but data_offsets span 8");
  refused("wrong_shape", raw(R"({"w":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", ok_data),
          "shape × F32 is 12 bytes");
  refused("huge_shape", raw(R"({"w":{"dtype":"F32","shape":[1099511627776],"data_offsets":[0,4398046511104]}})", ok_data),
          "tensor \"w\": data_offsets [0, 4398046511104] run past the 8-byte data buffer");
  refused("overflow", raw(R"({"w":{"dtype":"F32","shape":[4611686018427387904,4],"data_offsets":[0,8]}})", ok_data),
          "sizes overflow");
  refused("dim_too_big", raw(R"({"w":{"dtype":"F32","shape":[18446744073709551615],"data_offsets":[0,8]}})", ok_data),
          "not a non-negative integer below 2^63");
  refused("negative_dim", raw(R"({"w":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", ok_data),
          "a dimension is -2");
  refused("float_dim", raw(R"({"w":{"dtype":"F32","shape":[2.0],"data_offsets":[0,8]}})", ok_data), "a dimension is 2.0");
  refused("reversed", raw(R"({"w":{"dtype":"F32","shape":[0],"data_offsets":[8,0]}})", ok_data), "ends before it begins");
  refused("offsets_shape", raw(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0]}})", ok_data),
          "data_offsets is not an array [begin, end]");
  refused("overlap", raw(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", ok_data),
          "tensor \"b\" at bytes [4, 8) overlaps tensor \"a\"");
  refused("gap", raw(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", ok_data),
          "tensor \"a\" begins at byte 4 of the buffer, leaving bytes [0, 4) that no tensor holds");
  refused("trailing", raw(ok_header, ok_data + "xyz"), "the tensors end at byte 8 of the 11-byte data buffer");
  refused("unknown_field", raw(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8],"x":1}})", ok_data),
          "tensor \"w\" has an unknown field \"x\"");
  refused("missing_field", raw(R"({"w":{"dtype":"F32","shape":[2]}})", ok_data), "lacks dtype, shape or data_offsets");
  refused("metadata_value", raw(R"({"__metadata__":{"format":1},"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", ok_data),
          "\"__metadata__\" value of \"format\" is not a string");
  refused("tensor_not_object", raw(R"({"w":[1]})"), "tensor \"w\" is not a JSON object");
  // The header's padding: spaces (0x20) only, as the format says and the package writes.
  refused("nul_padding", raw(ok_header + std::string("\0\0garbage", 9), ok_data), "a NUL byte at offset 54");
  refused("newline_padding", raw(ok_header + "  \n", ok_data),
          "the header is padded with byte 0x0a at offset 64 of the file; the format pads with spaces (0x20) only");
  refused("garbage_padding", raw(ok_header + " }", ok_data), "is not valid JSON");
  EXPECT_EQ(SafetensorsReader(write_file("space_padding", raw(ok_header + "      ", ok_data))).read<double>("w"),
            (std::vector<double>{1, 2}));
  // Not a regular file: refused before anything blocks on it.
  const std::string fifo = tmp_path("fifo");
  fs::remove(fifo);
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  expect_error([&] { SafetensorsReader r(fifo); }, "is not a regular file");
  expect_error([&] { SafetensorsReader r(tmp_path("missing")); }, "cannot open");
  // A valid empty file, and metadata kept.
  const SafetensorsReader empty(write_file("empty_ok", raw(R"({"__metadata__":{"k":"v"}})")));
  EXPECT_TRUE(empty.tensors().empty());
  EXPECT_EQ(empty.metadata().at("k"), "v");
  expect_error([&] { (void)empty.at("w"); }, "no tensor \"w\"");
}

// A file that shrinks after its header was checked: a clear error, not garbage.
TEST(Safetensors, FileTruncatedAfterOpening) {
  const std::string p = write_file("shrinks", raw(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", f32_bytes({1, 2})));
  const SafetensorsReader r(p);
  ASSERT_EQ(::truncate(p.c_str(), 60), 0);
  expect_error([&] { (void)r.read<double>("w"); }, "the file ended early");
}

namespace {

// A folder with an index over shards {file: {tensor: value}}.
std::string sharded_folder(const std::string& name, const std::map<std::string, std::map<std::string, double>>& shards,
                           const std::string& weight_map) {
  const std::string dir = tmp_path(name);
  fs::remove_all(dir);
  fs::create_directories(dir);
  for (const auto& s : shards) {
    std::vector<std::vector<double>> v;
    for (const auto& t : s.second) v.push_back({t.second});
    std::vector<TensorToWrite> w;
    std::size_t i = 0;
    for (const auto& t : s.second) w.emplace_back(t.first, TensorDtype::f32, std::vector<std::int64_t>{1}, v[i++]);
    write_safetensors(dir + "/" + s.first, w);
  }
  std::ofstream(dir + "/model.safetensors.index.json") << R"({"metadata": {"total_size": 8}, "weight_map": )" << weight_map
                                                       << "}";
  return dir;
}

}  // namespace

TEST(Safetensors, ShardedIndex) {
  const std::map<std::string, std::map<std::string, double>> shards = {{"a.safetensors", {{"x", 1}, {"y", 2}}},
                                                                        {"b.safetensors", {{"z", 3}}}};
  const std::string dir =
      sharded_folder("good", shards, R"({"x": "a.safetensors", "y": "a.safetensors", "z": "b.safetensors"})");
  const SafetensorsSet s = SafetensorsSet::folder(dir);
  EXPECT_EQ(s.names(), (std::vector<std::string>{"x", "y", "z"}));
  EXPECT_EQ(s.files().size(), 2u);
  EXPECT_EQ(s.read<double>("z"), std::vector<double>{3});
  EXPECT_EQ(s.read<float>("y"), std::vector<float>{2});
  expect_error([&] { (void)s.at("w"); }, "no tensor \"w\"");

  auto refused = [&](const std::string& label, const std::string& map, const std::string& needle) {
    SCOPED_TRACE(label);
    const std::string d = sharded_folder(label, shards, map);
    expect_error([&] { (void)SafetensorsSet::folder(d); }, needle);
  };
  refused("unlisted", R"({"x": "a.safetensors", "z": "b.safetensors"})",
          "shard \"a.safetensors\" holds tensor \"y\", which the weight_map does not list");
  refused("wrong_shard", R"({"x": "a.safetensors", "y": "b.safetensors", "z": "b.safetensors"})",
          "tensor \"y\" is not in shard \"b.safetensors\"");
  refused("escape_dotdot", R"({"x": "../a.safetensors"})", "shard \"../a.safetensors\" of folder");
  refused("escape_slash", R"({"x": "sub/a.safetensors"})", "is not a plain file name inside the folder");
  refused("escape_abs", R"({"x": "/etc/passwd"})", "is not a plain file name inside the folder");
  refused("dotdot", R"({"x": ".."})", "is not a plain file name");
  refused("missing_shard", R"({"x": "c.safetensors"})", "shard \"c.safetensors\" of folder");
  refused("not_string", R"({"x": 1})", "tensor \"x\" maps to a non-string");
  refused("duplicate", R"({"x": "a.safetensors", "x": "a.safetensors"})", "duplicate key 'x'");
  refused("no_map", R"(1)", "has no \"weight_map\" object");
  // A tensor held by two shards, each listed.
  const std::string twice = sharded_folder("twice", {{"a.safetensors", {{"x", 1}}}, {"b.safetensors", {{"x", 1}, {"z", 3}}}},
                                           R"({"x": "a.safetensors", "z": "b.safetensors"})");
  expect_error([&] { (void)SafetensorsSet::folder(twice); },
               "tensor \"x\" is in shard \"b.safetensors\" and in the shard the weight_map names");
  // A shard that is a symbolic link leading out of the folder.
  const std::string outside = tmp_path("outside.safetensors");
  const std::vector<double> one{1};
  write_safetensors(outside, {TensorToWrite("x", TensorDtype::f32, {1}, one)});
  const std::string d = sharded_folder("link_out", {}, R"({"x": "a.safetensors"})");
  fs::create_symlink(outside, d + "/a.safetensors");
  expect_error([&] { (void)SafetensorsSet::folder(d); }, "is a symbolic link to '");
  // ... and one that stays inside it is followed.
  const std::string d2 = sharded_folder("link_in", {{"real.safetensors", {{"x", 5}}}}, R"({"x": "a.safetensors"})");
  fs::create_symlink("real.safetensors", d2 + "/a.safetensors");
  EXPECT_EQ(SafetensorsSet::folder(d2).read<double>("x"), std::vector<double>{5});
  // A folder with neither file.
  const std::string none = tmp_path("none");
  fs::create_directories(none);
  expect_error([&] { (void)SafetensorsSet::folder(none); }, "has neither model.safetensors nor");
}

// ---- the Hugging Face Mamba folder ------------------------------------------------

namespace {

nlohmann::json tiny_hf_config(bool tied) {
  return {{"architectures", {"MambaForCausalLM"}}, {"model_type", "mamba"}, {"hidden_size", 16}, {"state_size", 4},
          {"num_hidden_layers", 2}, {"vocab_size", 50}, {"expand", 2}, {"intermediate_size", 32}, {"conv_kernel", 4},
          {"time_step_rank", "auto"}, {"tie_word_embeddings", tied}, {"layer_norm_epsilon", 1e-5},
          {"use_bias", false}, {"use_conv_bias", true}, {"hidden_act", "silu"}, {"residual_in_fp32", true},
          {"initializer_range", 0.1}, {"fused_add_norm", true}, {"some_new_key", 1}};
}

// Every tensor of a configuration, filled with distinct values.
HfTensors tensors_for(const nlohmann::json& ash_config) {
  const MambaDims d = mamba_dims(ash_config, "test");
  HfTensors t;
  double next = 0.25;
  auto add = [&](const HfName& n) {
    HfTensor x;
    x.shape = n.ash_shape;
    std::int64_t count = 1;
    for (auto s : n.ash_shape) count *= s;
    for (std::int64_t i = 0; i < count; ++i) x.values.push_back(next += 0.0625);
    t[n.ash] = x;
  };
  for (const auto& n : hf_mamba_global_names(d)) add(n);
  for (std::int64_t k = 0; k < d.layers; ++k)
    for (const auto& n : hf_mamba_layer_names(d, k)) add(n);
  return t;
}

}  // namespace

TEST(HfMamba, ConfigMapping) {
  std::vector<std::string> ignored;
  const auto c = hf_mamba_config_to_ash(tiny_hf_config(true), "config.json", &ignored);
  EXPECT_EQ(c, nlohmann::json::parse(R"({"model": {"arch": "mamba", "width": 16, "state": 4, "layers": 2, "vocab": 50,
      "expand": 2, "conv_kernel": 4, "dt_rank": 0, "tie_embeddings": true, "norm_eps": 1e-5}})"));
  EXPECT_EQ(ignored, std::vector<std::string>{"some_new_key"});
  auto hf = tiny_hf_config(false);
  hf["time_step_rank"] = 3;
  hf.erase("expand");  // transformers' default 2
  const auto c2 = hf_mamba_config_to_ash(hf, "config.json");
  EXPECT_EQ(c2["model"]["dt_rank"], 3);
  EXPECT_EQ(c2["model"]["expand"], 2);
  EXPECT_EQ(c2["model"]["tie_embeddings"], false);
  // And back: what transformers reads as the same model.
  const auto back = ash_config_to_hf_mamba(c, TensorDtype::f64);
  for (const char* k : {"hidden_size", "state_size", "num_hidden_layers", "vocab_size", "expand", "intermediate_size",
                        "conv_kernel", "time_step_rank", "tie_word_embeddings", "layer_norm_epsilon", "model_type"})
    EXPECT_EQ(back[k], tiny_hf_config(true)[k]) << k;
  EXPECT_EQ(back["dtype"], "float64");
  EXPECT_EQ(back["residual_in_fp32"], false);
  EXPECT_EQ(ash_config_to_hf_mamba(c2, TensorDtype::f32)["time_step_rank"], 3);
  EXPECT_EQ(ash_config_to_hf_mamba(c2, TensorDtype::f32)["residual_in_fp32"], true);
  EXPECT_EQ(hf_mamba_config_to_ash(back, "back"), c);

  auto refused = [&](const char* key, const nlohmann::json& value, const std::string& needle) {
    SCOPED_TRACE(key);
    auto h = tiny_hf_config(true);
    if (value.is_null())
      h.erase(key);
    else
      h[key] = value;
    expect_error([&] { (void)hf_mamba_config_to_ash(h, "config.json"); }, needle);
  };
  refused("use_bias", true, "use_bias = true");
  refused("use_conv_bias", false, "use_conv_bias = false");
  refused("hidden_act", "gelu", "hidden_act \"gelu\" is not supported");
  refused("intermediate_size", 48, "intermediate_size 48 is not expand × hidden_size = 32");
  refused("rms_norm", false, "rms_norm = false");
  refused("model_type", "mamba3", "model_type \"mamba3\" is not \"mamba\"");
  refused("architectures", nlohmann::json::array({"MambaModel"}), "architectures [\"MambaModel\"]");
  refused("hidden_size", nullptr, "has no \"hidden_size\"");
  refused("state_size", 0, "\"state_size\" is 0, not a positive integer");
  refused("vocab_size", -5, "\"vocab_size\" is -5");
  refused("num_hidden_layers", 2.5, "\"num_hidden_layers\" is 2.5");
  refused("time_step_rank", "big", "\"time_step_rank\" is \"big\"");
  refused("tie_word_embeddings", 1, "\"tie_word_embeddings\" is 1, not true or false");
  refused("layer_norm_epsilon", -1.0, "\"layer_norm_epsilon\" is -1.0");
  refused("num_hidden_layers", std::int64_t(1) << 40, "model.layers 1099511627776 is above");
  refused("hidden_size", std::int64_t(1) << 62, "sizes overflow");
  expect_error([] { (void)mamba_dims(nlohmann::json::parse(R"({"model": {"arch": "ssm-resnet"}})"), "cfg"); },
               "model.arch \"ssm-resnet\" is not \"mamba\", \"falcon_mamba\" or \"mamba2\"");
}

// FalconMambaConfig (transformers' FalconMambaForCausalLM): MambaConfig's keys and
// mixer_rms_eps, read as model.arch = falcon_mamba and model.mixer_rms_eps and written back.
TEST(HfMamba, FalconMambaConfig) {
  auto hf = tiny_hf_config(false);
  hf["model_type"] = "falcon_mamba";
  hf["architectures"] = {"FalconMambaForCausalLM"};
  hf["mixer_rms_eps"] = 1e-3;
  hf["use_falcon_mambapy"] = false;  // FalconMambaConfig's old name of use_mambapy: its own key, not ignored
  std::vector<std::string> ignored;
  const auto c = hf_mamba_config_to_ash(hf, "config.json", &ignored);
  EXPECT_EQ(c, nlohmann::json::parse(R"({"model": {"arch": "falcon_mamba", "width": 16, "state": 4, "layers": 2,
      "vocab": 50, "expand": 2, "conv_kernel": 4, "dt_rank": 0, "tie_embeddings": false, "norm_eps": 1e-5,
      "mixer_rms_eps": 1e-3}})"));
  EXPECT_EQ(ignored, std::vector<std::string>{"some_new_key"});
  const MambaDims d = mamba_dims(c, "test");
  EXPECT_TRUE(d.falcon);
  EXPECT_EQ(d.mixer_rms_eps, 1e-3);
  const auto back = ash_config_to_hf_mamba(c, TensorDtype::f32);
  EXPECT_EQ(back["model_type"], "falcon_mamba");
  EXPECT_EQ(back["architectures"], nlohmann::json::array({"FalconMambaForCausalLM"}));
  EXPECT_EQ(back["mixer_rms_eps"], 1e-3);
  EXPECT_EQ(hf_mamba_config_to_ash(back, "back"), c);
  // The same keys as a Mamba's config.json, and mixer_rms_eps.
  auto mamba_back = ash_config_to_hf_mamba(hf_mamba_config_to_ash(tiny_hf_config(false), "m"), TensorDtype::f32);
  EXPECT_FALSE(mamba_back.contains("mixer_rms_eps"));
  mamba_back["mixer_rms_eps"] = 1e-3;
  for (auto it = mamba_back.begin(); it != mamba_back.end(); ++it)
    if (it.key() != "architectures" && it.key() != "model_type") EXPECT_EQ(back.at(it.key()), it.value()) << it.key();
  EXPECT_EQ(back.size(), mamba_back.size());
  // Defaults and the choice without model_type: by architectures.
  auto bare = hf;
  bare.erase("mixer_rms_eps");
  bare.erase("model_type");
  EXPECT_EQ(hf_mamba_config_to_ash(bare, "config.json")["model"]["mixer_rms_eps"], 1e-6);
  bare.erase("architectures");  // neither: a Mamba, as before
  EXPECT_EQ(hf_mamba_config_to_ash(bare, "config.json")["model"]["arch"], "mamba");
  // A Mamba's config.json with mixer_rms_eps: not a MambaConfig key, listed as ignored and not read.
  auto m = tiny_hf_config(true);
  m["mixer_rms_eps"] = 1e-3;
  ignored.clear();
  EXPECT_FALSE(hf_mamba_config_to_ash(m, "config.json", &ignored)["model"].contains("mixer_rms_eps"));
  EXPECT_EQ(ignored, (std::vector<std::string>{"mixer_rms_eps", "some_new_key"}));

  auto refused = [&](const char* key, const nlohmann::json& value, const std::string& needle) {
    SCOPED_TRACE(key);
    auto h = hf;
    if (value.is_null())
      h.erase(key);
    else
      h[key] = value;
    expect_error([&] { (void)hf_mamba_config_to_ash(h, "config.json"); }, needle);
  };
  refused("mixer_rms_eps", 0.0, "\"mixer_rms_eps\" is 0.0, not a positive number");
  refused("mixer_rms_eps", "x", "\"mixer_rms_eps\" is \"x\"");
  refused("architectures", nlohmann::json::array({"MambaForCausalLM"}),
          "architectures [\"MambaForCausalLM\"] is not [\"FalconMambaForCausalLM\"] (model_type \"falcon_mamba\")");
  refused("model_type", "mamba", "architectures [\"FalconMambaForCausalLM\"] is not [\"MambaForCausalLM\"]");
  refused("model_type", "falcon_h1", "model_type \"falcon_h1\" is not \"mamba\", \"falcon_mamba\" or \"mamba2\"");
  refused("use_bias", true, "use_bias = true");
  refused("use_conv_bias", false, "use_conv_bias = false");
  refused("hidden_act", "relu", "hidden_act \"relu\" is not supported");
  refused("intermediate_size", 48, "intermediate_size 48 is not expand × hidden_size = 32");
  refused("rms_norm", false, "rms_norm = false");
  auto no_type = hf;
  no_type.erase("model_type");
  no_type["architectures"] = {"FalconMambaModel"};
  expect_error([&] { (void)hf_mamba_config_to_ash(no_type, "config.json"); },
               "architectures [\"FalconMambaModel\"] is not [\"MambaForCausalLM\"], [\"FalconMambaForCausalLM\"] or "
               "[\"Mamba2ForCausalLM\"]");
  expect_error([] { (void)mamba_dims(nlohmann::json::parse(R"({"model": {"arch": "falcon_mamba", "width": 4,
      "state": 2, "layers": 1, "vocab": 5, "mixer_rms_eps": -1}})"), "cfg"); },
               "cfg: model: \"mixer_rms_eps\" is -1");

  // A folder: written and read back with its configuration; the model's layout is the mapping's.
  const auto tensors = tensors_for(c);
  Config cfg;
  cfg.merge(c, "config.json");
  cfg.validate();
  EXPECT_TRUE(cfg.model().mixer_norms());
  EXPECT_EQ(cfg.model().mixer_rms_eps, 1e-3);
  const auto layout = param_layout(cfg.model());
  ASSERT_EQ(layout.size(), tensors.size());
  for (const auto& t : layout) EXPECT_EQ(tensors.at(t.name).shape, t.shape) << t.name;
  const std::string dir = tmp_path("hf_falcon");
  fs::remove_all(dir);
  write_hf_mamba(dir, cfg.json(), tensors, TensorDtype::f64);
  const HfMambaModel r = read_hf_mamba(dir);
  EXPECT_EQ(r.config, c);
  for (const auto& x : tensors) EXPECT_EQ(r.tensors.at(x.first).values, x.second.values) << x.first;
  auto extra = tensors;
  extra["layers/000/b_layernorm"] = extra.at("layers/000/D");
  expect_error([&] { write_hf_mamba(dir, c, extra); }, "writing FalconMamba folder");
}

// Mamba2Config (transformers' Mamba2ForCausalLM): its keys read as
// model.arch = mamba2 and written back; its tensors are the layout's; what we do
// not build refused by name.
TEST(HfMamba, Mamba2Config) {
  const auto hf = nlohmann::json::parse(R"({"architectures": ["Mamba2ForCausalLM"], "model_type": "mamba2",
      "hidden_size": 16, "state_size": 4, "num_hidden_layers": 2, "vocab_size": 50, "expand": 2, "conv_kernel": 3,
      "head_dim": 8, "num_heads": 4, "n_groups": 1, "tie_word_embeddings": false, "layer_norm_epsilon": 1e-4,
      "time_step_limit": [0.01, {"__float__": "Infinity"}], "use_bias": false, "use_conv_bias": true,
      "hidden_act": "silu", "residual_in_fp32": true, "chunk_size": 256, "time_step_rank": 1,
      "rescale_prenorm_residual": false, "some_new_key": 1})");
  std::vector<std::string> ignored;
  const auto c = hf_mamba_config_to_ash(hf, "config.json", &ignored);
  EXPECT_EQ(c, nlohmann::json::parse(R"({"model": {"arch": "mamba2", "width": 16, "state": 4, "layers": 2,
      "vocab": 50, "expand": 2, "conv_kernel": 3, "head_dim": 8, "heads": 4, "n_groups": 1,
      "tie_embeddings": false, "norm_eps": 1e-4, "time_step_limit_min": 0.01, "time_step_limit_max": 0.0}})"));
  EXPECT_EQ(ignored, std::vector<std::string>{"some_new_key"});
  const MambaDims d = mamba_dims(c, "test");
  EXPECT_TRUE(d.mamba2);
  EXPECT_EQ(d.head_count(), 4);
  EXPECT_EQ(d.conv_dim(), 40);
  const auto back = ash_config_to_hf_mamba(c, TensorDtype::f32);
  for (auto it = hf.begin(); it != hf.end(); ++it)
    if (it.key() != "some_new_key") EXPECT_EQ(back.at(it.key()), it.value()) << it.key();
  EXPECT_EQ(hf_mamba_config_to_ash(back, "back"), c);
  EXPECT_EQ(ash_config_to_hf_mamba(c, TensorDtype::f64)["residual_in_fp32"], false);
  // A finite upper limit both ways; defaults: untied, no limit.
  auto h = hf;
  h["time_step_limit"] = {0.0, 0.5};
  EXPECT_EQ(hf_mamba_config_to_ash(h, "c")["model"]["time_step_limit_max"], 0.5);
  EXPECT_EQ(ash_config_to_hf_mamba(hf_mamba_config_to_ash(h, "c"), TensorDtype::f32)["time_step_limit"], h["time_step_limit"]);
  h.erase("time_step_limit");
  h.erase("tie_word_embeddings");
  EXPECT_EQ(hf_mamba_config_to_ash(h, "c")["model"]["time_step_limit_max"], 0.0);
  EXPECT_EQ(hf_mamba_config_to_ash(h, "c")["model"]["tie_embeddings"], false);
  h.erase("model_type");  // architectures alone says which model
  EXPECT_EQ(hf_mamba_config_to_ash(h, "c")["model"]["arch"], "mamba2");

  auto refused = [&](const char* key, const nlohmann::json& value, const std::string& needle) {
    SCOPED_TRACE(key);
    auto x = hf;
    if (value.is_null())
      x.erase(key);
    else
      x[key] = value;
    expect_error([&] { (void)hf_mamba_config_to_ash(x, "config.json"); }, needle);
  };
  refused("n_groups", 3, "n_groups 3 does not divide num_heads 4");
  refused("n_groups", nullptr, "n_groups 8 does not divide num_heads 4");  // Mamba2Config's default
  {  // two groups of B and C: the conv's channels E + 2·G·N, both ways
    auto g2 = hf;
    g2["n_groups"] = 2;
    const auto c2 = hf_mamba_config_to_ash(g2, "config.json");
    EXPECT_EQ(c2["model"]["n_groups"], 2);
    EXPECT_EQ(mamba_dims(c2, "test").conv_dim(), 32 + 2 * 2 * 4);
    EXPECT_EQ(ash_config_to_hf_mamba(c2, TensorDtype::f32)["n_groups"], 2);
  }
  refused("num_heads", 3, "num_heads × head_dim = 24 is not expand × hidden_size = 32");
  refused("num_heads", nullptr, "num_heads × head_dim = 1024");  // Mamba2Config's default 128
  refused("time_step_limit", nlohmann::json::array({0.5, 0.1}), "\"time_step_limit\" is [0.5,0.1]");
  refused("time_step_limit", nlohmann::json::array({0.0}), "not [min, max]");
  refused("time_step_limit", nlohmann::json::array({0.0, nlohmann::json{{"__float__", "NaN"}}}), "\"time_step_limit\"");
  refused("use_bias", true, "use_bias = true");
  refused("use_conv_bias", false, "use_conv_bias = false");
  refused("hidden_act", "gelu", "hidden_act \"gelu\" is not supported");
  refused("architectures", nlohmann::json::array({"MambaForCausalLM"}),
          "architectures [\"MambaForCausalLM\"] is not [\"Mamba2ForCausalLM\"] (model_type \"mamba2\")");
  expect_error([] { (void)mamba_dims(nlohmann::json::parse(R"({"model": {"arch": "mamba2", "width": 4, "state": 2,
      "layers": 1, "vocab": 5, "head_dim": 4, "dt_rank": 2}})"), "cfg"); }, "model.dt_rank applies to a Mamba-1");

  // A folder: written and read back; the model's layout is the mapping's.
  const auto tensors = tensors_for(c);
  Config cfg;
  cfg.merge(c, "config.json");
  cfg.validate();
  EXPECT_TRUE(cfg.model().mamba2());
  const auto layout = param_layout(cfg.model());
  ASSERT_EQ(layout.size(), tensors.size());
  for (const auto& t : layout) EXPECT_EQ(tensors.at(t.name).shape, t.shape) << t.name;
  const auto names = hf_mamba_layer_names(d, 1);
  ASSERT_EQ(names.size(), 9u);
  EXPECT_EQ(names[2].hf, "backbone.layers.1.mixer.conv1d.weight");
  EXPECT_EQ(names[2].hf_shape, (std::vector<std::int64_t>{40, 1, 3}));
  EXPECT_EQ(names[7].hf, "backbone.layers.1.mixer.norm.weight");
  EXPECT_EQ(names[7].ash, "layers/001/gated_norm");
  const std::string dir = tmp_path("hf_mamba2");
  fs::remove_all(dir);
  write_hf_mamba(dir, cfg.json(), tensors, TensorDtype::f64);
  const HfMambaModel r = read_hf_mamba(dir);
  EXPECT_EQ(r.config, c);
  for (const auto& x : tensors) EXPECT_EQ(r.tensors.at(x.first).values, x.second.values) << x.first;
  // Python's bare Infinity (older transformers' config.json), outside strings only.
  std::string text = ash_config_to_hf_mamba(c, TensorDtype::f64).dump();
  const std::string tagged = R"({"__float__":"Infinity"})";
  text.replace(text.find(tagged), tagged.size(), "Infinity");
  text.insert(1, R"("note": "Infinity, NaN", )");
  std::ofstream(dir + "/config.json", std::ios::trunc) << text;
  const HfMambaModel bare = read_hf_mamba(dir);
  EXPECT_EQ(bare.config, c);
  EXPECT_EQ(bare.ignored, std::vector<std::string>{"note"});
  auto extra = tensors;
  extra["layers/000/x_proj"] = extra.at("layers/000/D");
  expect_error([&] { write_hf_mamba(dir, c, extra); }, "writing Mamba2 folder");
}

TEST(HfMamba, LayerNames) {
  MambaDims d;
  d.width = 16, d.state = 4, d.layers = 2, d.vocab = 50, d.tie_embeddings = false;
  const auto g = hf_mamba_global_names(d);
  ASSERT_EQ(g.size(), 3u);
  EXPECT_EQ(g[2].hf, "lm_head.weight");
  EXPECT_EQ(g[2].ash, "head");
  const auto l = hf_mamba_layer_names(d, 1);
  ASSERT_EQ(l.size(), 10u);
  EXPECT_EQ(l[2].hf, "backbone.layers.1.mixer.conv1d.weight");
  EXPECT_EQ(l[2].ash, "layers/001/conv_weight");
  EXPECT_EQ(l[2].hf_shape, (std::vector<std::int64_t>{32, 1, 4}));
  EXPECT_EQ(l[2].ash_shape, (std::vector<std::int64_t>{32, 4}));
  EXPECT_EQ(l[4].hf_shape, (std::vector<std::int64_t>{1 + 8, 32}));  // x_proj: R = ceil(16/16) = 1
  EXPECT_EQ(hf_mamba_layer_names(d, 123)[0].ash, "layers/123/norm");
}

TEST(HfMamba, FolderRoundTrip) {
  for (const bool tied : {true, false}) {
    for (const TensorDtype t : {TensorDtype::f32, TensorDtype::f64}) {
      SCOPED_TRACE(std::string(tied ? "tied " : "untied ") + dtype_name(t));
      const auto cfg = hf_mamba_config_to_ash(tiny_hf_config(tied), "config.json");
      const auto tensors = tensors_for(cfg);
      const std::string dir = tmp_path(std::string("hf_") + (tied ? "tied_" : "untied_") + dtype_name(t));
      fs::remove_all(dir);
      write_hf_mamba(dir, cfg, tensors, t);
      const HfMambaModel m = read_hf_mamba(dir);
      EXPECT_EQ(m.config, cfg);
      EXPECT_TRUE(m.ignored.empty());
      ASSERT_EQ(m.tensors.size(), tensors.size());
      EXPECT_EQ(m.tensors.count("head"), tied ? 0u : 1u);
      for (const auto& x : tensors) {
        const HfTensor& y = m.tensors.at(x.first);
        EXPECT_EQ(y.shape, x.second.shape) << x.first;
        EXPECT_EQ(y.values, x.second.values) << x.first;  // exact in float: multiples of 1/16 below 2^20
        EXPECT_EQ(y.dtype, t);
      }
      const SafetensorsReader r(dir + "/model.safetensors");
      EXPECT_EQ(r.at("backbone.layers.1.mixer.conv1d.weight").shape, (std::vector<std::int64_t>{32, 1, 4}));
      EXPECT_EQ(r.metadata().at("format"), "pt");
    }
  }
}

TEST(HfMamba, FolderRefusals) {
  const auto cfg = hf_mamba_config_to_ash(tiny_hf_config(false), "config.json");
  const auto good = tensors_for(cfg);
  const std::string dir = tmp_path("hf");
  fs::remove_all(dir);
  // The writer checks before it writes anything.
  auto missing = good;
  missing.erase("layers/001/D");
  expect_error([&] { write_hf_mamba(dir, cfg, missing); }, "tensor 'layers/001/D' is missing");
  EXPECT_FALSE(fs::exists(dir));
  auto extra = good;
  extra["layers/002/D"] = good.at("layers/001/D");
  expect_error([&] { write_hf_mamba(dir, cfg, extra); }, "tensor 'layers/002/D' is not part of this configuration");
  auto reshaped = good;
  reshaped["layers/000/conv_weight"].shape = {32, 1, 4};
  expect_error([&] { write_hf_mamba(dir, cfg, reshaped); }, "tensor 'layers/000/conv_weight' has shape [32, 1, 4]");
  auto short_values = good;
  short_values["final_norm"].values.pop_back();
  expect_error([&] { write_hf_mamba(dir, cfg, short_values); }, "tensor 'final_norm' holds 15 values");

  // A folder written, then edited: each edit refused naming the tensor.
  write_hf_mamba(dir, cfg, good);
  const std::string st = dir + "/model.safetensors";
  auto rewrite = [&](const std::function<void(std::vector<TensorToWrite>&, std::vector<std::vector<double>>&)>& edit) {
    const SafetensorsReader r(st);
    std::vector<std::vector<double>> v;
    for (const auto& e : r.tensors()) v.push_back(r.read<double>(e.name));
    std::vector<TensorToWrite> w;
    for (std::size_t i = 0; i < v.size(); ++i) w.emplace_back(r.tensors()[i].name, r.tensors()[i].dtype, r.tensors()[i].shape, v[i]);
    edit(w, v);
    write_safetensors(st, w);
  };
  const std::vector<double> extra_values(32, 0.0);
  rewrite([&](auto& w, auto&) { w.emplace_back("backbone.layers.0.mixer.extra", TensorDtype::f32, std::vector<std::int64_t>{32}, extra_values); });
  expect_error([&] { (void)read_hf_mamba(dir); }, "unexpected tensor 'backbone.layers.0.mixer.extra'");
  write_hf_mamba(dir, cfg, good);
  rewrite([&](auto& w, auto&) {
    w.erase(std::find_if(w.begin(), w.end(), [](const TensorToWrite& t) { return t.name == "lm_head.weight"; }));
  });
  expect_error([&] { (void)read_hf_mamba(dir); }, "tensor 'lm_head.weight' (head) is missing");
  write_hf_mamba(dir, cfg, good);
  rewrite([&](auto& w, auto&) {
    for (auto& t : w)
      if (t.name == "backbone.layers.1.mixer.A_log") t.shape = {4, 32};
  });
  expect_error([&] { (void)read_hf_mamba(dir); }, "tensor 'backbone.layers.1.mixer.A_log' has shape [4, 32]; config.json implies [32, 4]");

  // A tied folder that also holds lm_head.weight: accepted only as a copy of the embedding.
  const auto tcfg = hf_mamba_config_to_ash(tiny_hf_config(true), "config.json");
  const auto tgood = tensors_for(tcfg);
  write_hf_mamba(dir, tcfg, tgood);
  const std::vector<double> emb = tgood.at("embedding").values;
  rewrite([&](auto& w, auto&) { w.emplace_back("lm_head.weight", TensorDtype::f32, std::vector<std::int64_t>{50, 16}, emb); });
  EXPECT_EQ(read_hf_mamba(dir).tensors.count("head"), 0u);
  std::vector<double> other = emb;
  other[7] += 1;
  write_hf_mamba(dir, tcfg, tgood);
  rewrite([&](auto& w, auto&) { w.emplace_back("lm_head.weight", TensorDtype::f32, std::vector<std::int64_t>{50, 16}, other); });
  expect_error([&] { (void)read_hf_mamba(dir); }, "'lm_head.weight' differs from backbone.embeddings.weight");
  // A copy is bit for bit: -0.0 where the embedding holds 0.0 differs (the export could not give it back).
  auto tzero = tgood;
  tzero.at("embedding").values[3] = 0.0;
  std::vector<double> negzero = tzero.at("embedding").values;
  negzero[3] = -0.0;
  write_hf_mamba(dir, tcfg, tzero);
  rewrite([&](auto& w, auto&) { w.emplace_back("lm_head.weight", TensorDtype::f32, std::vector<std::int64_t>{50, 16}, negzero); });
  expect_error([&] { (void)read_hf_mamba(dir); }, "'lm_head.weight' differs from backbone.embeddings.weight");

  // config.json: missing, too deep, a link out of the folder.
  fs::remove(dir + "/config.json");
  expect_error([&] { (void)read_hf_mamba(dir); }, "config \"config.json\" of folder");
  std::ofstream(dir + "/config.json") << std::string(100, '[') << std::string(100, ']');
  expect_error([&] { (void)read_hf_mamba(dir); }, "levels deep");
  // A byte order mark, or a NUL byte and more after the document (transformers refuses both).
  std::ofstream(dir + "/config.json", std::ios::binary) << "\xEF\xBB\xBF" << tiny_hf_config(true).dump();
  expect_error([&] { (void)read_hf_mamba(dir); }, "byte order mark");
  std::ofstream(dir + "/config.json", std::ios::binary) << tiny_hf_config(true).dump() << std::string(1, '\0') << "}}";
  expect_error([&] { (void)read_hf_mamba(dir); }, "a NUL byte");
  fs::remove(dir + "/config.json");
  const std::string outside = tmp_path("outside_config.json");
  std::ofstream(outside) << tiny_hf_config(true).dump();
  fs::create_symlink(outside, dir + "/config.json");
  expect_error([&] { (void)read_hf_mamba(dir); }, "outside the folder");
}

}  // namespace ash::test

namespace ash::test {

// The glue of `ash import-hf` / `export-hf`: the configuration fragment merges into a
// Config whose model (model/params' layout) has exactly the tensors, names and shapes
// the folder mapping reads and writes; and a whole Config writes a folder.
TEST(HfMamba, MatchesTheModelLayout) {
  for (const bool tied : {true, false}) {
    for (const nlohmann::json rank : {nlohmann::json("auto"), nlohmann::json(3)}) {
      SCOPED_TRACE(std::string(tied ? "tied, " : "untied, ") + "time_step_rank " + rank.dump());
      auto hf = tiny_hf_config(tied);
      hf["time_step_rank"] = rank;
      const auto fragment = hf_mamba_config_to_ash(hf, "config.json");
      Config cfg;
      cfg.merge(fragment, "config.json");
      cfg.validate();
      const auto tensors = tensors_for(fragment);
      const auto layout = param_layout(cfg.model());
      ASSERT_EQ(layout.size(), tensors.size());
      for (const auto& t : layout) {
        ASSERT_EQ(tensors.count(t.name), 1u) << t.name;
        EXPECT_EQ(tensors.at(t.name).shape, t.shape) << t.name;
      }
      const std::string dir = tmp_path(std::string("whole_config_") + (tied ? "tied_" : "untied_") + (rank.is_string() ? "auto" : "3"));
      fs::remove_all(dir);
      write_hf_mamba(dir, cfg.json(), tensors);  // the whole document: other sections and model.seed unread
      EXPECT_EQ(read_hf_mamba(dir).config, fragment);
    }
  }
}

}  // namespace ash::test
