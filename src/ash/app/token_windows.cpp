#include "ash/app/token_windows.hpp"

#include "ash/core/documents.hpp"
#include "ash/io/tokens.hpp"

namespace ash {

const std::vector<std::uint32_t>& TokenSource::read(std::vector<std::uint32_t>& storage) const {
  if (ids) return *ids;
  storage = load_tokens(path);
  return storage;
}

std::string TokenSource::name() const { return ids ? "the token array" : "token file '" + path + "'"; }

DocumentStarts document_starts(const std::vector<std::uint32_t>& ids, const std::string& separator) {
  DocumentStarts d;
  d.on = !separator.empty();
  if (d.on) separator_starts(ids, separator_tokens(separator), d.flags);
  return d;
}

TokenView first_windows(const std::vector<std::uint32_t>& ids, const Settings& st) {
  const auto docs = document_starts(ids, st.data.separator);
  return make_windows(ids, st.data.batch, st.data.seq_len, st.model.vocab, 0, docs.documents());
}

}  // namespace ash
