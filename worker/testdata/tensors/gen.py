#!/usr/bin/python3
"""Writes the small .pt files of worker/core/tensor_files_test.cc (run with /usr/bin/python3,
torch >= 1.6, from this directory: `/usr/bin/python3 gen.py`). Values are deterministic
(arange), so the test can check exact sample bytes:

  float/      train-00000.pt  x float32 [3,3,4] = arange(0, 36),  y int64 [3] = arange(0, 3)
              train-00001.pt  x float32 [2,3,4] = arange(36, 60), y int64 [2] = arange(3, 5)
              test-00000.pt   x float32 [2,3,4] = arange(100, 124), y int64 [2] = [7, 8]
              (plus notes.txt, never matched)
  seq/        train.pt        x int64 [4,5] = arange(20), y int64 [4,5] = arange(20) + 1
  half/       train.pt        x float16 [3,2] = arange(6) / 4, y float32 [3,2] = arange(6) * 2;
                              an extra key "meta" (an int) that is ignored
  uint8/      train.pt        x uint8 [5,2,2] = arange(20) * 10, y int64 [5] = arange(5)
              train-view.pt   x uint8 [2,2,2] stored at storage offset 4 of a bigger storage
                              (a contiguous slice), y int64 [2] = [5, 6]
  bad/        lengths.pt      x [3,4], y [2]
              not_tensor.pt   x = 5
              noncontig.pt    x = arange(12).reshape(3,4).t()
              missing_y.pt    only "x"
              truncated.pt    float/train-00000.pt cut to 3/4 of its length
              bigendian.pt    float/test-00000.pt plus an entry byteorder = "big"
              deflated.pt     float/test-00000.pt with its entries deflated
  zip64/      test.pt         float/test-00000.pt rewritten by hand with every size and offset
                              of the central directory in zip64 extra fields (0xFFFFFFFF in
                              the entries), as files over 4 GiB have them
  mismatch/   train-a.pt      x float32 [2,3], train-b.pt x float32 [2,4] (other per-sample shape)
"""
import os
import struct
import zipfile

import torch


def zip64_copy(src, dst):
    """Rewrites zip `src` as `dst` with zip64 extra fields for every entry (stored, no data
    descriptors), a zip64 end of central directory record and its locator."""
    with zipfile.ZipFile(src) as z:
        entries = [(i.filename, z.read(i.filename), i.CRC) for i in z.infolist()]
    out, central = bytearray(), bytearray()
    for name, data, crc in entries:
        offset = len(out)
        n = name.encode()
        out += struct.pack("<IHHHHHIIIHH", 0x04034B50, 45, 0, 0, 0, 0, crc, len(data),
                           len(data), len(n), 0) + n + data
        extra = struct.pack("<HHQQQ", 1, 24, len(data), len(data), offset)
        central += struct.pack("<IHHHHHHIIIHHHHHII", 0x02014B50, 45, 45, 0, 0, 0, 0, crc,
                               0xFFFFFFFF, 0xFFFFFFFF, len(n), len(extra), 0, 0, 0, 0,
                               0xFFFFFFFF) + n + extra
    cd_offset = len(out)
    out += central
    z64 = len(out)
    out += struct.pack("<IQHHIIQQQQ", 0x06064B50, 44, 45, 45, 0, 0, len(entries), len(entries),
                       len(central), cd_offset)
    out += struct.pack("<IIQI", 0x07064B50, 0, z64, 1)
    out += struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, 0xFFFF, 0xFFFF, 0xFFFFFFFF, 0xFFFFFFFF, 0)
    with open(dst, "wb") as f:
        f.write(out)


def save(path, **tensors):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    torch.save(tensors, path)


def main():
    save("float/train-00000.pt", x=torch.arange(0, 36, dtype=torch.float32).reshape(3, 3, 4),
         y=torch.arange(0, 3))
    save("float/train-00001.pt", x=torch.arange(36, 60, dtype=torch.float32).reshape(2, 3, 4),
         y=torch.arange(3, 5))
    save("float/test-00000.pt", x=torch.arange(100, 124, dtype=torch.float32).reshape(2, 3, 4),
         y=torch.tensor([7, 8]))
    with open("float/notes.txt", "w") as f:
        f.write("not a .pt file\n")

    save("seq/train.pt", x=torch.arange(20).reshape(4, 5), y=torch.arange(20).reshape(4, 5) + 1)
    os.makedirs("half", exist_ok=True)
    torch.save({"x": torch.arange(6, dtype=torch.float16).reshape(3, 2) / 4,
                "y": torch.arange(6, dtype=torch.float32).reshape(3, 2) * 2,
                "meta": 3}, "half/train.pt")
    save("uint8/train.pt", x=(torch.arange(20) * 10).to(torch.uint8).reshape(5, 2, 2),
         y=torch.arange(5))
    big = (torch.arange(12) + 200).to(torch.uint8)
    save("uint8/train-view.pt", x=big[4:12].reshape(2, 2, 2), y=torch.tensor([5, 6]))

    save("bad/lengths.pt", x=torch.zeros(3, 4), y=torch.zeros(2, dtype=torch.int64))
    os.makedirs("bad", exist_ok=True)
    torch.save({"x": 5, "y": torch.zeros(2)}, "bad/not_tensor.pt")
    save("bad/noncontig.pt", x=torch.arange(12, dtype=torch.float32).reshape(3, 4).t(),
         y=torch.zeros(4, dtype=torch.int64))
    save("bad/missing_y.pt", x=torch.zeros(2, 2))
    with open("float/train-00000.pt", "rb") as f:
        data = f.read()
    with open("bad/truncated.pt", "wb") as f:
        f.write(data[: len(data) * 3 // 4])

    with zipfile.ZipFile("float/test-00000.pt") as z:
        entries = [(i.filename, z.read(i.filename)) for i in z.infolist()]
    def rezip(path, method, extra=()):
        with zipfile.ZipFile(path, "w") as z:
            for name, data in list(entries) + list(extra):
                info = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))  # Reproducible.
                info.compress_type = method
                z.writestr(info, data)

    rezip("bad/bigendian.pt", zipfile.ZIP_STORED, [("test-00000/byteorder", b"big")])
    rezip("bad/deflated.pt", zipfile.ZIP_DEFLATED)

    os.makedirs("zip64", exist_ok=True)
    zip64_copy("float/test-00000.pt", "zip64/test.pt")
    with zipfile.ZipFile("zip64/test.pt") as z:  # Python's reader agrees.
        assert torch.load("zip64/test.pt")["y"].tolist() == [7, 8]

    save("mismatch/train-a.pt", x=torch.zeros(2, 3), y=torch.zeros(2, dtype=torch.int64))
    save("mismatch/train-b.pt", x=torch.zeros(2, 4), y=torch.zeros(2, dtype=torch.int64))
    # Test labels of another integer dtype than the training ones (taken as they are), and
    # test inputs of another dtype (refused: the model takes the training inputs' dtype).
    save("labels32/train.pt", x=torch.arange(8, dtype=torch.float32).reshape(4, 2),
         y=torch.tensor([0, 1, 1, 0]))
    save("labels32/test.pt", x=torch.arange(4, dtype=torch.float32).reshape(2, 2),
         y=torch.tensor([1, 0], dtype=torch.int32))
    save("xdouble/train.pt", x=torch.zeros(2, 2), y=torch.tensor([0, 1]))
    save("xdouble/test.pt", x=torch.zeros(2, 2, dtype=torch.float64), y=torch.tensor([0, 1]))


if __name__ == "__main__":
    main()
