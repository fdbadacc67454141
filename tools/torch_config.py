"""Prints what meson needs to build against the installed torch wheel, one item per line:
include dirs (';'-joined), library dir, C++11 ABI flag (0/1), torch version, CUDA version or ''."""
import os
import sys
import warnings

warnings.filterwarnings("ignore")
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
try:
    import torch
    from torch.utils import cpp_extension
except Exception as exc:  # noqa: BLE001 - report any import failure to meson
    sys.stderr.write(f"conveyor: cannot import torch ({exc}); run ./run build so it gets installed\n")
    sys.exit(1)

print(";".join(cpp_extension.include_paths()))
print(cpp_extension.library_paths()[0])
print(int(torch._C._GLIBCXX_USE_CXX11_ABI))
print(torch.__version__)
print(torch.version.cuda or "")
