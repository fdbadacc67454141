// What an error message may quote of an input: a short, printable excerpt.
#pragma once

#include <string>
#include <string_view>

namespace conveyor {

/// `text` cut to `limit` bytes ("..." marks the cut), bytes that are not printable ASCII as '?'.
inline std::string printable(std::string_view text, std::size_t limit) {
  std::string out;
  for (std::size_t i = 0; i < text.size() && i < limit; ++i) {
    const unsigned char c = static_cast<unsigned char>(text[i]);
    out += (c >= 0x20 && c < 0x7f) ? static_cast<char>(c) : '?';
  }
  if (text.size() > limit) out += "...";
  return out;
}

}  // namespace conveyor
