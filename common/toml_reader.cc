#include "common/toml_reader.h"

#include "common/file.h"

#include "common/printable.h"

#include <cctype>
#include <charconv>
#include <cmath>
#include <limits>

namespace conveyor::toml {

const Node* Node::get(std::string_view key) const {
  if (kind_ != Kind::kTable) return nullptr;
  const auto it = index_.find(std::string(key));
  return it == index_.end() ? nullptr : &items_[it->second];
}

std::optional<std::string> Node::string() const {
  if (kind_ != Kind::kString) return std::nullopt;
  return text_;
}

std::optional<std::int64_t> Node::integer() const {
  if (kind_ != Kind::kInteger) return std::nullopt;
  return integer_;
}

std::optional<double> Node::number() const {
  if (kind_ == Kind::kFloat) return number_;
  if (kind_ == Kind::kInteger) return static_cast<double>(integer_);
  return std::nullopt;
}

std::optional<bool> Node::boolean() const {
  if (kind_ != Kind::kBool) return std::nullopt;
  return boolean_;
}

namespace {

// What an error may quote of the file: at most 40 bytes, printable ASCII.
std::string shown(std::string_view text) { return printable(text, 40); }

// Length of the well-formed UTF-8 sequence at `s[i]`, or 0.
std::size_t utf8_length(std::string_view s, std::size_t i) {
  const auto b = [&](std::size_t k) { return static_cast<unsigned char>(s[k]); };
  const unsigned char c = b(i);
  std::size_t n = c < 0x80 ? 1 : (c >> 5) == 0x6 ? 2 : (c >> 4) == 0xE ? 3 : (c >> 3) == 0x1E ? 4 : 0;
  if (n == 0 || i + n > s.size()) return 0;
  std::uint32_t cp = n == 1 ? c : n == 2 ? (c & 0x1F) : n == 3 ? (c & 0x0F) : (c & 0x07);
  for (std::size_t k = 1; k < n; ++k) {
    if ((b(i + k) & 0xC0) != 0x80) return 0;
    cp = (cp << 6) | (b(i + k) & 0x3F);
  }
  const std::uint32_t least[] = {0, 0, 0x80, 0x800, 0x10000};
  if (cp < least[n] || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return 0;
  return n;
}

void append_utf8(std::string& out, std::uint32_t cp) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

bool bare_key_char(char c) {
  return (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_' || c == '-';
}

}  // namespace

class Parser {
 public:
  explicit Parser(std::string_view text) : s_(text) {}

  Node document() {
    check_encoding();
    Node root;
    root.kind_ = Node::Kind::kTable;
    Node* current = &root;
    while (true) {
      skip_blank();
      if (at_end()) break;
      const char c = s_[i_];
      if (c == '#') {
        skip_comment();
      } else if (c == '\n' || c == '\r') {
        newline();
      } else if (c == '[') {
        current = header(root);
        end_of_line();
      } else {
        key_value(*current, header_depth_);
        end_of_line();
      }
    }
    return root;
  }

 private:
  [[noreturn]] void fail(const std::string& what) const { throw TomlError(line_, "not valid TOML: " + what); }
  bool at_end() const { return i_ >= s_.size(); }
  char peek(std::size_t ahead = 0) const { return i_ + ahead < s_.size() ? s_[i_ + ahead] : '\0'; }
  bool starts(std::string_view t) const { return s_.substr(i_, t.size()) == t; }

  void check_encoding() {
    int line = 1;
    for (std::size_t k = 0; k < s_.size();) {
      const std::size_t n = utf8_length(s_, k);
      if (n == 0) throw TomlError(line, "not valid TOML: the file is not valid UTF-8 (TOML files must be)");
      if (s_[k] == '\n') ++line;
      k += n;
    }
  }

  void skip_blank() {
    while (!at_end() && (s_[i_] == ' ' || s_[i_] == '\t')) ++i_;
  }
  void skip_comment() {
    while (!at_end() && s_[i_] != '\n' && s_[i_] != '\r') {
      const unsigned char c = static_cast<unsigned char>(s_[i_]);
      if ((c < 0x20 && c != '\t') || c == 0x7f) fail("a control character in a comment");
      ++i_;
    }
  }
  void newline() {
    if (peek() == '\r') {
      if (peek(1) != '\n') fail("a carriage return not followed by a newline");
      ++i_;
    }
    ++i_;
    ++line_;
  }
  // Blanks, comments and newlines (inside arrays).
  void skip_space() {
    while (!at_end()) {
      const char c = s_[i_];
      if (c == ' ' || c == '\t') ++i_;
      else if (c == '#') skip_comment();
      else if (c == '\n' || c == '\r') newline();
      else break;
    }
  }
  void end_of_line() {
    skip_blank();
    if (peek() == '#') skip_comment();
    if (at_end()) return;
    if (peek() != '\n' && peek() != '\r') fail("expected the end of the line, found '" + shown(s_.substr(i_, 20)) + "'");
    newline();
  }

  [[noreturn]] void too_deep() const {
    fail("values nest more than " + std::to_string(kMaxDepth) +
         " deep (table headers' and dotted keys' parts, arrays and inline tables together); conveyor's files "
         "nest a few levels: see docs/formats.md");
  }

  // A key: bare, "basic" or 'literal' parts joined by dots.
  std::vector<std::string> key() {
    std::vector<std::string> parts;
    while (true) {
      if (static_cast<int>(parts.size()) >= kMaxDepth) too_deep();
      skip_blank();
      if (peek() == '"') {
        parts.push_back(quoted_string(false));
      } else if (peek() == '\'') {
        parts.push_back(quoted_string(false));
      } else {
        const std::size_t from = i_;
        while (!at_end() && bare_key_char(s_[i_])) ++i_;
        if (i_ == from) fail(at_end() ? "expected a key, found the end of the file" : "expected a key, found '" + shown(s_.substr(i_, 20)) + "'");
        parts.emplace_back(s_.substr(from, i_ - from));
      }
      skip_blank();
      if (peek() != '.') return parts;
      ++i_;
    }
  }

  static std::string joined(const std::vector<std::string>& parts, std::size_t n) {
    std::string out;
    for (std::size_t k = 0; k < n && k < parts.size(); ++k) out += (k ? "." : "") + shown(parts[k]);
    return out;
  }

  Node* child(Node& table, const std::string& name) {
    const auto it = table.index_.find(name);
    return it == table.index_.end() ? nullptr : &table.items_[it->second];
  }
  Node& add(Node& table, const std::string& name, Node value) {
    table.index_.emplace(name, table.keys_.size());
    table.keys_.push_back(name);
    table.items_.push_back(std::move(value));
    return table.items_.back();
  }
  Node new_table() const {
    Node t;
    t.kind_ = Node::Kind::kTable;
    t.line_ = line_;
    return t;
  }

  // The table a header's or dotted key's leading parts name, made where missing.
  Node& walk(Node& from, const std::vector<std::string>& parts, std::size_t n, bool dotted) {
    Node* t = &from;
    for (std::size_t k = 0; k < n; ++k) {
      Node* next = child(*t, parts[k]);
      if (next == nullptr) {
        Node made = new_table();
        made.by_dotted_key_ = dotted;
        next = &add(*t, parts[k], std::move(made));
      } else if (next->kind_ == Node::Kind::kArray && next->table_array_ && !dotted) {
        next = &next->items_.back();
      } else if (next->kind_ != Node::Kind::kTable || next->frozen_ || (dotted && next->header_defined_)) {
        fail("'" + joined(parts, k + 1) + "' is already a value (defined on line " + std::to_string(next->line_) + ")");
      }
      t = next;
    }
    return *t;
  }

  Node* header(Node& root) {
    const bool array = starts("[[");
    i_ += array ? 2 : 1;
    const auto parts = key();
    header_depth_ = static_cast<int>(parts.size());
    if (!(array ? starts("]]") : starts("]"))) fail(std::string("expected '") + (array ? "]]" : "]") + "' to close the header");
    i_ += array ? 2 : 1;
    Node& parent = walk(root, parts, parts.size() - 1, false);
    Node* existing = child(parent, parts.back());
    if (array) {
      if (existing == nullptr) {
        Node list;
        list.kind_ = Node::Kind::kArray;
        list.line_ = line_;
        list.table_array_ = true;
        existing = &add(parent, parts.back(), std::move(list));
      } else if (existing->kind_ != Node::Kind::kArray || !existing->table_array_) {
        fail("[[" + joined(parts, parts.size()) + "]]: '" + shown(parts.back()) + "' is already defined on line " +
             std::to_string(existing->line_) + " as something else");
      }
      existing->items_.push_back(new_table());
      return &existing->items_.back();
    }
    if (existing == nullptr) {
      existing = &add(parent, parts.back(), new_table());
    } else if (existing->kind_ != Node::Kind::kTable || existing->header_defined_ || existing->by_dotted_key_ ||
               existing->frozen_) {
      fail("[" + joined(parts, parts.size()) + "] is defined twice (first on line " + std::to_string(existing->line_) + ")");
    }
    existing->header_defined_ = true;
    existing->line_ = line_;
    return existing;
  }

  // `depth`: how deep `table` nests (a header's parts, inline tables and arrays around it).
  void key_value(Node& table, int depth) {
    const auto parts = key();
    if (peek() != '=') fail("expected '=' after the key '" + joined(parts, parts.size()) + "'");
    ++i_;
    skip_blank();
    const int level = depth + static_cast<int>(parts.size()) - 1;
    if (level >= kMaxDepth) too_deep();
    Node& parent = walk(table, parts, parts.size() - 1, true);
    if (Node* old = child(parent, parts.back())) {
      fail("'" + joined(parts, parts.size()) + "' is defined twice (first on line " + std::to_string(old->line_) + ")");
    }
    add(parent, parts.back(), value(level));
  }

  Node value(int depth) {
    if (depth >= kMaxDepth) too_deep();
    Node v;
    v.line_ = line_;
    const char c = peek();
    if (c == '"') {
      v.kind_ = Node::Kind::kString;
      v.text_ = quoted_string(true);
    } else if (c == '\'') {
      v.kind_ = Node::Kind::kString;
      v.text_ = quoted_string(true);
    } else if (starts("true") || starts("false")) {
      v.kind_ = Node::Kind::kBool;
      v.boolean_ = c == 't';
      i_ += v.boolean_ ? 4 : 5;
    } else if (c == '[') {
      array(v, depth);
    } else if (c == '{') {
      inline_table(v, depth);
    } else {
      number(v);
    }
    return v;
  }

  void array(Node& v, int depth) {
    v.kind_ = Node::Kind::kArray;
    v.frozen_ = true;
    ++i_;
    while (true) {
      skip_space();
      if (at_end()) fail("the array opened on line " + std::to_string(v.line_) + " is never closed");
      if (peek() == ']') break;
      v.items_.push_back(value(depth + 1));
      skip_space();
      if (peek() == ',') {
        ++i_;
      } else if (peek() != ']') {
        fail("expected ',' or ']' in the array opened on line " + std::to_string(v.line_));
      }
    }
    ++i_;
  }

  void inline_table(Node& v, int depth) {
    v.kind_ = Node::Kind::kTable;
    v.frozen_ = true;
    ++i_;
    skip_blank();
    if (peek() == '}') {
      ++i_;
      return;
    }
    while (true) {
      key_value(v, depth + 1);
      skip_blank();
      if (peek() == '}') break;
      if (peek() != ',') fail("expected ',' or '}' in the inline table (inline tables stay on one line)");
      ++i_;
    }
    ++i_;
  }

  // A string: "basic" (escapes) or 'literal' (none) and, where `multiline_ok`, their
  // triple-quoted multi-line forms.
  std::string quoted_string(bool multiline_ok) {
    const char quote = s_[i_];
    const std::string triple(3, quote);
    const bool multi = multiline_ok && starts(triple);
    i_ += multi ? 3 : 1;
    if (multi && (peek() == '\n' || peek() == '\r')) newline();
    std::string out;
    while (true) {
      if (at_end()) fail("a string is never closed");
      const char c = s_[i_];
      if (c == quote && (!multi || starts(triple))) {
        std::size_t quotes = multi ? 3 : 1;
        while (multi && quotes < 5 && peek(quotes) == quote) ++quotes;  // up to two quotes may end the text
        out.append(quotes - (multi ? 3 : 1), quote);
        i_ += quotes;
        return out;
      }
      if (c == '\\' && quote == '"') {
        ++i_;
        escape(out, multi);
      } else if (c == '\n' || c == '\r') {
        if (!multi) fail("a string runs past the end of its line (close it, or use " + triple + " for several lines)");
        out += '\n';
        newline();
      } else {
        const unsigned char u = static_cast<unsigned char>(c);
        if ((u < 0x20 && c != '\t') || u == 0x7f) fail("a control character in a string (write it as an escape)");
        out += c;
        ++i_;
      }
    }
  }

  void escape(std::string& out, bool multi) {
    const char e = peek();
    switch (e) {
      case 'b': out += '\b'; ++i_; return;
      case 't': out += '\t'; ++i_; return;
      case 'n': out += '\n'; ++i_; return;
      case 'f': out += '\f'; ++i_; return;
      case 'r': out += '\r'; ++i_; return;
      case '"': out += '"'; ++i_; return;
      case '\\': out += '\\'; ++i_; return;
      case 'u':
      case 'U': {
        const std::size_t n = e == 'u' ? 4 : 8;
        std::uint32_t cp = 0;
        for (std::size_t k = 1; k <= n; ++k) {
          const char h = peek(k);
          const int d = h >= '0' && h <= '9' ? h - '0' : h >= 'a' && h <= 'f' ? h - 'a' + 10 : h >= 'A' && h <= 'F' ? h - 'A' + 10 : -1;
          if (d < 0) fail(std::string("\\") + e + " needs " + std::to_string(n) + " hexadecimal digits");
          cp = cp * 16 + static_cast<std::uint32_t>(d);
        }
        if (cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) fail("\\" + std::string(1, e) + " names no Unicode scalar value");
        append_utf8(out, cp);
        i_ += n + 1;
        return;
      }
      default: break;
    }
    if (multi) {  // a backslash ending a line joins it to the next, dropping the blanks between
      std::size_t k = i_;
      while (k < s_.size() && (s_[k] == ' ' || s_[k] == '\t')) ++k;
      if (k < s_.size() && (s_[k] == '\n' || s_[k] == '\r')) {
        i_ = k;
        skip_space_only_newlines();
        return;
      }
    }
    fail("unknown escape '\\" + shown(s_.substr(i_, 1)) + "' in a string");
  }

  void skip_space_only_newlines() {
    while (!at_end()) {
      const char c = s_[i_];
      if (c == ' ' || c == '\t') ++i_;
      else if (c == '\n' || c == '\r') newline();
      else break;
    }
  }

  // Integers (decimal, 0x, 0o, 0b; '_' between digits) and floats (with inf and nan).
  void number(Node& v) {
    const std::size_t from = i_;
    while (!at_end() && (bare_key_char(s_[i_]) || s_[i_] == '+' || s_[i_] == '.' || s_[i_] == ':')) ++i_;
    const std::string_view token = s_.substr(from, i_ - from);
    if (token.empty()) fail(at_end() ? "expected a value, found the end of the file" : "expected a value, found '" + shown(s_.substr(i_, 20)) + "'");
    const std::string bad = "'" + shown(token) + "' is not a value (a string needs quotes)";
    std::string_view body = token;
    const bool negative = !body.empty() && body[0] == '-';
    if (!body.empty() && (body[0] == '+' || body[0] == '-')) body.remove_prefix(1);
    if (body == "inf" || body == "nan") {
      v.kind_ = Node::Kind::kFloat;
      v.number_ = body == "inf" ? std::numeric_limits<double>::infinity() : std::numeric_limits<double>::quiet_NaN();
      if (negative) v.number_ = -v.number_;
      return;
    }
    if (token.find(':') != std::string_view::npos || (token.size() >= 5 && token[4] == '-' && token[0] != '-')) {
      fail("'" + shown(token) + "': dates and times are not used in conveyor's files");
    }
    int base = 10;
    if (body.size() > 2 && body[0] == '0' && (body[1] == 'x' || body[1] == 'o' || body[1] == 'b')) {
      if (body.size() != token.size()) fail(bad);  // no sign before 0x
      base = body[1] == 'x' ? 16 : body[1] == 'o' ? 8 : 2;
      body.remove_prefix(2);
    }
    std::string digits;
    for (std::size_t k = 0; k < body.size(); ++k) {
      if (body[k] == '_') {
        const auto digit = [&](std::size_t at) { return at < body.size() && std::isxdigit(static_cast<unsigned char>(body[at])); };
        if (k == 0 || !digit(k - 1) || !digit(k + 1)) fail(bad);
        continue;
      }
      digits += body[k];
    }
    if (digits.empty()) fail(bad);
    const bool is_float = base == 10 && digits.find_first_of(".eE") != std::string::npos;
    if (!is_float && base == 10 && digits.size() > 1 && digits[0] == '0') fail("'" + shown(token) + "': integers have no leading zeros");
    if (is_float) {
      if (digits[0] == '.' || digits.back() == '.' || digits.find(".e") != std::string::npos ||
          digits.find(".E") != std::string::npos) {
        fail(bad);
      }
      double d = 0;
      const auto r = std::from_chars(digits.data(), digits.data() + digits.size(), d);
      if (r.ec == std::errc::result_out_of_range) fail("'" + shown(token) + "' is out of the range of a float");
      if (r.ec != std::errc() || r.ptr != digits.data() + digits.size()) fail(bad);
      v.kind_ = Node::Kind::kFloat;
      v.number_ = negative ? -d : d;
      return;
    }
    std::uint64_t magnitude = 0;
    const auto r = std::from_chars(digits.data(), digits.data() + digits.size(), magnitude, base);
    if (r.ec == std::errc::result_out_of_range) fail("'" + shown(token) + "' is out of the range of a 64-bit integer");
    if (r.ec != std::errc() || r.ptr != digits.data() + digits.size()) fail(bad);
    const std::uint64_t limit = negative ? std::uint64_t{1} << 63 : (std::uint64_t{1} << 63) - 1;
    if (magnitude > limit) fail("'" + shown(token) + "' is out of the range of a 64-bit integer");
    v.kind_ = Node::Kind::kInteger;
    v.integer_ = negative ? static_cast<std::int64_t>(0 - magnitude) : static_cast<std::int64_t>(magnitude);
  }

  std::string_view s_;
  std::size_t i_ = 0;
  int line_ = 1;
  int header_depth_ = 0;  ///< the parts of the last [header]: how deep its keys start
};

Node parse(std::string_view text) {
  if (text.size() > kConfigFileLimit) {
    throw TomlError(1, "the document is " + std::to_string(text.size()) + " bytes, more than the " +
                           std::to_string(kConfigFileLimit >> 20) + " MiB a TOML file may hold (docs/formats.md)");
  }
  return Parser(text).document();
}

void check_keys(const Node& t, std::initializer_list<std::string_view> allowed, const char* where) {
  for (std::size_t k = 0; k < t.keys().size(); ++k) {
    bool ok = false;
    for (auto a : allowed) ok |= t.keys()[k] == a;
    if (ok) continue;
    std::string list;
    for (auto a : allowed) list += (list.empty() ? "" : ", ") + std::string(a);
    throw TomlError(t.items()[k].line(), "unknown key '" + shown(t.keys()[k]) + "' in " + where + " (expected " + list + ")");
  }
}

}  // namespace conveyor::toml
