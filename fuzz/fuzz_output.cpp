// What the tool finds at the paths it writes: the first bytes plant something at
// the output file, at the directory's lock file and at temporary-looking names
// (nothing, a regular file, a symbolic link to a victim file, a dangling link, a
// directory, a FIFO, a hard link to the victim); then the run lock is taken and a
// checkpoint written, as `ash init --out` does; then the same at a folder and
// its config.json, replaced as `ash export-hf` does (io::AtomicFolder).
// ash::Error is an expected answer; a changed victim, a write over anything but
// nothing or a regular file (docs/cli.md, Output files), a refused node that
// changed, or a temporary file or folder left behind is a finding (trap).
// docs/design.md §7.
#include <sys/stat.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>

#include <Kokkos_Core.hpp>

#include "ash/core/config.hpp"
#include "ash/core/error.hpp"
#include "ash/io/atomic_write.hpp"
#include "ash/io/checkpoint.hpp"
#include "ash/io/run_lock.hpp"
#include "ash/model/params.hpp"

namespace fs = std::filesystem;

extern "C" int LLVMFuzzerInitialize(int* argc, char*** argv) {
  Kokkos::initialize(*argc, *argv);
  return 0;
}

namespace {
const std::string victim_text = "the victim's contents\n";

std::string slurp(const std::string& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

// Plants kind k (mod 7) at path, unless something is there already (the harness
// never writes through what it planted); victim is the file links point to.
void plant(const std::string& path, std::uint8_t k, const std::string& victim) {
  std::error_code ec;
  if (fs::exists(fs::symlink_status(path, ec))) return;
  switch (k % 7) {
    case 0: break;
    case 1: std::ofstream(path) << "old"; break;
    case 2: fs::create_symlink(victim, path, ec); break;
    case 3: fs::create_symlink(path + ".nowhere", path, ec); break;
    case 4: fs::create_directory(path, ec); break;
    case 5: ::mkfifo(path.c_str(), 0600); break;
    case 6: fs::create_hard_link(victim, path, ec); break;
  }
}

fs::file_type kind(const std::string& path) {
  std::error_code ec;
  return fs::symlink_status(path, ec).type();
}

// The output rule: what may be written over.
bool writable(fs::file_type t) { return t == fs::file_type::not_found || t == fs::file_type::regular; }

// An entry of `dir` whose name contains `part` (a temporary file or folder left).
bool left_in(const std::string& dir, const std::string& part) {
  std::error_code ec;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec))
    if (it->path().filename().string().find(part) != std::string::npos) return true;
  return false;
}

// export-hf's step: folder `dir` (something planted at it and at its config.json)
// replaced with one holding config.json "{}".
void replace_folder(const std::string& root, const std::uint8_t* k, const std::string& victim) {
  const std::string dir = root + "/e", cfg = dir + "/config.json";
  plant(dir, k[0], victim);
  if (kind(dir) == fs::file_type::directory) {
    plant(cfg, k[1], victim);
    std::ofstream(dir + "/README") << "kept";
  }
  const auto before = kind(dir), cfg_before = kind(cfg);
  bool written = false;
  try {
    ash::io::AtomicFolder f(dir, {"config.json"});
    ash::io::AtomicFile w(f.path("config.json"));
    w.write("{}", 2);
    w.commit();
    f.commit();
    written = true;
  } catch (const ash::Error&) {
  }
  if (written) {
    if (before != fs::file_type::not_found && before != fs::file_type::directory) __builtin_trap();  // a link, ...
    if (before == fs::file_type::directory && !writable(cfg_before)) __builtin_trap();
    if (slurp(cfg) != "{}" || kind(dir) != fs::file_type::directory) __builtin_trap();
    if (before == fs::file_type::directory && slurp(dir + "/README") != "kept") __builtin_trap();
  } else if (kind(dir) != before || kind(cfg) != cfg_before) {
    __builtin_trap();  // a refused or failed replacement changed the folder
  }
  // ".e.tmp.XXXXXX" or ".e.old.XXXXXX" beside it, "config.json.tmp.XXXXXX" in it.
  if (left_in(root, ".e.") || (kind(dir) == fs::file_type::directory && left_in(dir, ".tmp."))) __builtin_trap();
}
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size < 3) return 0;
  static const std::string root = "/tmp/ash_fuzz_output." + std::to_string(::getpid());
  std::error_code ec;
  fs::remove_all(root, ec);
  fs::create_directories(root + "/d");
  const std::string victim = root + "/victim.h5", out = root + "/d/x.h5";
  std::ofstream(victim) << victim_text;
  plant(out, data[0], victim);
  plant(root + "/d/.lock", data[1], victim);
  for (std::size_t i = 2; i < size && i < 6; ++i)  // temporary-looking names, old and new style
    plant(out + (data[i] & 1 ? ".tmp." + std::to_string(::getpid()) : ".tmp.fuzz" + std::to_string(i)), data[i] >> 1,
          victim);
  const auto before = kind(out);
  bool written = false;
  try {
    auto lock = ash::RunLock::for_output(out);
    ash::Config cfg;
    cfg.set("model.vocab=4");
    cfg.set("model.width=2");
    cfg.set("model.state=1");
    cfg.set("model.layers=1");
    ash::ParamSet<float> ps(cfg.model());
    ash::save_checkpoint(out, cfg, ps);
    written = true;
  } catch (const ash::Error&) {
  }
  if (slurp(victim) != victim_text) __builtin_trap();  // written through a link or a hard link
  if (written && (fs::is_symlink(out) || !fs::is_regular_file(out))) __builtin_trap();
  if (written && !writable(before)) __builtin_trap();            // renamed over a FIFO, a directory, a link
  if (!written && !writable(before) && kind(out) != before) __builtin_trap();  // a refused node changed
  if (size >= 8) replace_folder(root, data + 6, victim);
  if (slurp(victim) != victim_text) __builtin_trap();
  fs::remove_all(root, ec);
  return 0;
}
