"""Prints the folder of the libucx-cu13 wheel's UCX (include/, lib/) and its version, one per
line, or nothing when the wheel is absent (meson then looks for a system UCX through
pkg-config). CONVEYOR_UCX_PREFIX names an unpacked wheel's libucx folder instead.

The wheel's own pkg-config files name the machine it was built on, so meson is told the
folder directly rather than through them."""
import os
import sys

folder = os.environ.get("CONVEYOR_UCX_PREFIX")
if not folder:
    try:
        import libucx
    except ImportError:
        sys.exit(0)
    folder = os.path.dirname(os.path.abspath(libucx.__file__))
version_file = os.path.join(folder, "UCX_WHEEL_VERSION.txt")
if not os.path.isfile(os.path.join(folder, "include", "ucp", "api", "ucp.h")):
    sys.stderr.write(f"conveyor: {folder} holds no UCX headers (include/ucp/api/ucp.h); "
                     "reinstall libucx-cu13 or unset CONVEYOR_UCX_PREFIX\n")
    sys.exit(1)
print(folder)
print(open(version_file).read().strip() if os.path.isfile(version_file) else "unknown")
