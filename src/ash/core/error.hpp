#pragma once
// Every user-facing failure (bad config, bad file, bad sizes) is an ash::Error
// with a message that names the problem; the CLI prints it and exits non-zero.
#include <cstdio>
#include <stdexcept>
#include <string>

namespace ash {

// msg with every byte that is not part of a valid UTF-8 sequence, and every
// control character but newline and tab, written as \xNN: a message may quote
// names read from a hostile file (an HDF5 object's, a tensor's), and a terminal
// or Python (whose str must be valid UTF-8) gets it intact and harmless.
inline std::string printable(const std::string& msg) {
  std::string out;
  out.reserve(msg.size());
  const auto* b = reinterpret_cast<const unsigned char*>(msg.data());
  const std::size_t n = msg.size();
  const auto cont = [&](std::size_t i, unsigned char lo = 0x80, unsigned char hi = 0xBF) {
    return i < n && b[i] >= lo && b[i] <= hi;
  };
  for (std::size_t i = 0; i < n;) {
    const unsigned char c = b[i];
    std::size_t len = 0;  // length of a valid sequence starting at i (0: none)
    if (c >= 0x20 && c < 0x7F)
      len = 1;
    else if (c == '\n' || c == '\t')
      len = 1;
    else if (c >= 0xC2 && c <= 0xDF)
      len = cont(i + 1) ? 2 : 0;
    else if (c == 0xE0)
      len = cont(i + 1, 0xA0) && cont(i + 2) ? 3 : 0;
    else if ((c >= 0xE1 && c <= 0xEC) || c == 0xEE || c == 0xEF)
      len = cont(i + 1) && cont(i + 2) ? 3 : 0;
    else if (c == 0xED)
      len = cont(i + 1, 0x80, 0x9F) && cont(i + 2) ? 3 : 0;
    else if (c == 0xF0)
      len = cont(i + 1, 0x90) && cont(i + 2) && cont(i + 3) ? 4 : 0;
    else if (c >= 0xF1 && c <= 0xF3)
      len = cont(i + 1) && cont(i + 2) && cont(i + 3) ? 4 : 0;
    else if (c == 0xF4)
      len = cont(i + 1, 0x80, 0x8F) && cont(i + 2) && cont(i + 3) ? 4 : 0;
    if (len > 0) {
      out.append(msg, i, len);
      i += len;
    } else {
      char esc[5];
      std::snprintf(esc, sizeof esc, "\\x%02x", unsigned(c));
      out += esc;
      ++i;
    }
  }
  return out;
}

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& msg) : std::runtime_error(printable(msg)) {}
  explicit Error(const char* msg) : Error(std::string(msg)) {}
};

inline void require(bool ok, const std::string& msg) {
  if (!ok) throw Error(msg);
}

}  // namespace ash
