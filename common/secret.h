// The secret a job's processes share, and the keyed hashes that prove it without sending it:
// the rendezvous admits a process only when its join request carries HMAC-SHA256(secret, a
// nonce process 0 just handed out + the request), and process 0's answer carries one over the
// joining process's own nonce (docs/design.md, "Rendezvous"). SHA-256 is written here
// (FIPS 180-4) so the runtime needs no crypto library.
#pragma once

#include <string>
#include <string_view>

#include "common/status.h"

namespace conveyor::secret {

/// SHA-256 of `data`, 32 bytes.
std::string sha256(std::string_view data);

/// HMAC-SHA256 (RFC 2104) of `message` under `key`, as 64 lowercase hex digits.
std::string hmac_hex(std::string_view key, std::string_view message);

/// `bytes` as lowercase hex digits, and back (`from_hex` skips a trailing odd digit).
std::string to_hex(std::string_view bytes);
std::string from_hex(std::string_view text);

/// Equal strings, compared in time that depends only on their lengths.
bool same(std::string_view a, std::string_view b);

/// `bytes` random bytes from the kernel (getrandom), as hex.
std::string random_hex(std::size_t bytes);

/// The job's secret: CONVEYOR_JOB_SECRET (set by `conveyor launch` for the processes it
/// starts), or else this user's secret file in the cache folder (made on first use, readable by
/// this user only): processes of one user on one machine, or sharing a home, agree on it.
Result<std::string> job_secret();

}  // namespace conveyor::secret
