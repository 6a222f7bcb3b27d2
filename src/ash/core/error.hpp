#pragma once
// Every user-facing failure (bad config, bad file, bad sizes) is an ash::Error
// with a message that names the problem; the CLI prints it and exits non-zero.
#include <stdexcept>
#include <string>

namespace ash {

class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

inline void require(bool ok, const std::string& msg) {
  if (!ok) throw Error(msg);
}

}  // namespace ash
