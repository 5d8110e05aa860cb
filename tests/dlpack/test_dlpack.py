"""DLPack against PyTorch: dtensor tensors go to torch and torch tensors come to dtensor without a copy.

usage: test_dlpack.py <path to dlpack_peer's shared library>
Exits 77 (skipped) when torch cannot be imported, or 1 when DTENSOR_REQUIRE_TORCH=1 (the test command).
"""
import ctypes
import gc
import os
import sys

try:
    import torch
    import torch.utils.dlpack
except ImportError as e:
    if os.environ.get("DTENSOR_REQUIRE_TORCH") == "1":
        print(f"FAIL: {e} ({sys.executable}); DTENSOR_REQUIRE_TORCH=1 needs torch (Debian: python3-torch)")
        sys.exit(1)
    print(f"note: {e}; skipping the DLPack consumer test")
    sys.exit(77)

peer = ctypes.CDLL(sys.argv[1])
peer.dtensor_test_make.restype = ctypes.c_void_p
peer.dtensor_test_make.argtypes = [ctypes.c_int]
peer.dtensor_test_data_ptr.restype = ctypes.c_void_p
peer.dtensor_test_data_ptr.argtypes = [ctypes.c_void_p]
peer.dtensor_test_last_error.restype = ctypes.c_char_p
peer.dtensor_test_consume.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                                      ctypes.POINTER(ctypes.c_float)]

capsule_new = ctypes.pythonapi.PyCapsule_New
capsule_new.restype = ctypes.py_object
capsule_new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
capsule_get = ctypes.pythonapi.PyCapsule_GetPointer
capsule_get.restype = ctypes.c_void_p
capsule_get.argtypes = [ctypes.py_object, ctypes.c_char_p]
capsule_rename = ctypes.pythonapi.PyCapsule_SetName
capsule_rename.restype = ctypes.c_int
capsule_rename.argtypes = [ctypes.py_object, ctypes.c_char_p]

failures = []


def check(cond, what):
    if not cond:
        failures.append(what)
        print(f"FAILED: {what}")


def from_dtensor(kind):
    """dtensor's tensor `kind` as a torch tensor, and the data pointer dtensor exported."""
    managed = peer.dtensor_test_make(kind)
    data = peer.dtensor_test_data_ptr(managed)
    # torch consumes the capsule (renames it "used_dltensor"); it always does here, so no destructor.
    return torch.utils.dlpack.from_dlpack(capsule_new(managed, b"dltensor", None)), data


# dtensor -> torch: every dtype DLPack 0.6 can name, values, strides and the very same memory.
cases = [
    (0, torch.float32, (3, 4), (4, 1), torch.arange(12.0).reshape(3, 4)),
    (1, torch.float32, (2, 3), (6, 1), torch.arange(24.0).reshape(4, 6)[1:3, 2:5]),
    (2, torch.bfloat16, (2, 3), (3, 1), torch.arange(6.0).reshape(2, 3)),
    (3, torch.float16, (2, 3), (3, 1), torch.arange(6.0).reshape(2, 3)),
    (4, torch.float64, (2, 3), (3, 1), torch.arange(6.0).reshape(2, 3)),
    (5, torch.int32, (5,), (1,), torch.arange(5)),
    (6, torch.int64, (5,), (1,), torch.arange(5)),
    (7, torch.uint8, (2, 2), (2, 1), torch.arange(4).reshape(2, 2)),
]
for kind, dtype, shape, strides, expected in cases:
    t, data = from_dtensor(kind)
    check(t.dtype == dtype, f"kind {kind}: dtype {t.dtype}, expected {dtype}")
    check(t.device.type == "cpu", f"kind {kind}: device {t.device}")
    check(tuple(t.shape) == shape, f"kind {kind}: shape {tuple(t.shape)}, expected {shape}")
    check(t.stride() == strides, f"kind {kind}: strides {t.stride()}, expected {strides}")
    check(t.data_ptr() == data, f"kind {kind}: torch's data_ptr {t.data_ptr():#x} is not dtensor's {data:#x}")
    check(torch.equal(t, expected.to(dtype)), f"kind {kind}: values {t} != {expected}")
    check(peer.dtensor_test_live_exports() == 1, f"kind {kind}: {peer.dtensor_test_live_exports()} live exports")
    del t
    gc.collect()
    check(peer.dtensor_test_live_exports() == 0,
          f"kind {kind}: the storage outlived the torch tensor ({peer.dtensor_test_live_exports()} live)")

# A write through torch lands in dtensor's memory (seen again through a second import of the same kind is
# not possible, so check through the exported pointer).
t, data = from_dtensor(0)
t[1, 2] = 42.0
check(ctypes.cast(data, ctypes.POINTER(ctypes.c_float))[6] == 42.0, "a torch write did not reach dtensor's memory")
del t
gc.collect()


# torch -> dtensor: contiguous, narrowed (offset and row stride) and transposed tensors.
def to_dtensor(x):
    capsule = torch.utils.dlpack.to_dlpack(x)
    managed = capsule_get(capsule, b"dltensor")
    expected = (x.real if x.is_complex() else x).contiguous().flatten().tolist()
    values = (ctypes.c_float * len(expected))(*expected)
    calls = peer.dtensor_test_import_deleter_calls()
    rc = peer.dtensor_test_consume(managed, x.data_ptr(), x.shape[0], x.shape[1], values)
    if rc == 0:
        capsule_rename(capsule, b"used_dltensor")  # dtensor owns it now; torch must not delete it again
    return rc, peer.dtensor_test_import_deleter_calls() - calls


for name, x in [
    ("contiguous", torch.arange(12.0).reshape(3, 4)),
    ("narrowed", torch.arange(24.0).reshape(4, 6)[1:3, 2:5]),
    ("transposed", torch.arange(12.0).reshape(3, 4).t()),
]:
    rc, calls = to_dtensor(x)
    check(rc == 0, f"{name}: dtensor_test_consume returned {rc} ({peer.dtensor_test_last_error().decode()})")
    check(calls == 1, f"{name}: from_dlpack called torch's deleter {calls} times, expected once")
    check(x[0, 0].item() == -1.0, f"{name}: dtensor's write did not reach torch's memory")

# What dtensor cannot hold: an Error naming it, the deleter not called, the capsule still torch's.
rc, calls = to_dtensor(torch.zeros(2, 2, dtype=torch.complex64))
check(rc == 3, f"complex64: dtensor_test_consume returned {rc}, expected 3 (an Error)")
check("kDLComplex bits 64" in peer.dtensor_test_last_error().decode(),
      f"complex64: error {peer.dtensor_test_last_error().decode()!r}")
check(calls == 0, f"complex64: the deleter was called {calls} times by a failed import")
gc.collect()

if failures:
    print(f"{len(failures)} check(s) failed")
    sys.exit(1)
print("DLPack with torch", torch.__version__, ": all checks passed")
