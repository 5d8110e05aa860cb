"""Opens a consolidated dtensor checkpoint (write_consolidated.cpp) with Python's standard library alone,
as the safetensors format describes it (--reader stdlib), or with torch (--reader torch; exits 77, ctest's
skip, when torch is not installed, or 1 with DTENSOR_REQUIRE_TORCH=1); checks every value bit for bit.
usage: read_consolidated.py FILE.safetensors --reader stdlib|torch"""
import json
import math
import os
import struct
import sys

EXPECTED = {  # name: (dtype, shape, seed), values sin(flat + seed) * 3 + 1/3 (integers: floor(1000 x))
    "w": ("F32", [7, 5], 0),
    "layer.1/b": ("F64", [3, 2], 1),
    "ids": ("I64", [2, 3], 2),
}
FORMATS = {"F32": "f", "F64": "d", "I64": "q"}


def expected(dtype, shape, seed):
    vals = [math.sin(k + seed) * 3.0 + 1.0 / 3.0 for k in range(shape[0] * shape[1])]
    if dtype == "I64":
        vals = [math.floor(v * 1000) for v in vals]
    return struct.pack("<%d%s" % (len(vals), FORMATS[dtype]), *vals)


def main(path, reader):
    with open(path, "rb") as f:
        blob = f.read()
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8 : 8 + n])
    data = blob[8 + n :]
    assert (8 + n) % 8 == 0, "the data section starts 8-aligned"
    assert header.pop("__metadata__") == {"format": "pt"}
    assert sorted(header) == sorted(EXPECTED), sorted(header)
    end = 0
    for name, (dtype, shape, seed) in EXPECTED.items():
        entry = header[name]
        assert entry["dtype"] == dtype and entry["shape"] == shape, (name, entry)
        begin, stop = entry["data_offsets"]
        assert data[begin:stop] == expected(dtype, shape, seed), name + ": values differ"
        end = max(end, stop)
    assert end == len(data), "the tensors tile the data"
    if reader == "stdlib":
        print("standard library: ok")
        return 0
    try:
        import torch
    except ImportError:
        if os.environ.get("DTENSOR_REQUIRE_TORCH") == "1":
            print("FAIL: torch is not installed for " + sys.executable + " and DTENSOR_REQUIRE_TORCH=1 needs it")
            return 1
        print("torch is not installed for " + sys.executable + ": skipped")
        return 77
    torch_dtypes = {"F32": torch.float32, "F64": torch.float64, "I64": torch.int64}
    for name, (dtype, shape, seed) in EXPECTED.items():
        begin, stop = header[name]["data_offsets"]
        t = torch.frombuffer(bytearray(data[begin:stop]), dtype=torch_dtypes[dtype]).reshape(shape)
        ref = torch.frombuffer(bytearray(expected(dtype, shape, seed)), dtype=torch_dtypes[dtype]).reshape(shape)
        assert torch.equal(t, ref), name
    print("standard library and torch %s: ok" % torch.__version__)
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 4 or sys.argv[2] != "--reader" or sys.argv[3] not in ("stdlib", "torch"):
        sys.exit(__doc__)
    sys.exit(main(sys.argv[1], sys.argv[3]))
