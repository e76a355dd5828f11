"""The one-launch Triton staging kernels against the torch ones, on CPU tensors: run as a
script with TRITON_INTERPRET=1 (Triton's interpreter follows the pointer table into host
memory), by tests/unit/test_staging_torch.py where Triton is installed.

Each case is (row bytes, column, width, rows in a buffer, rows copied): slices whose sizes
allow 8-, 4-, 2- and 1-byte words, more rows than one program's tile, a slice wider than a
tile, and whole rows.
"""

from __future__ import annotations

import torch  # type: ignore[import-not-found,unused-ignore]

from kvbridge.staging import torch_kernels, triton_kernels

CASES = [
    (64, 16, 32, 40, 7),
    (1024, 512, 512, 300, 257),
    (30, 5, 3, 50, 33),
    (12, 4, 6, 20, 20),
    (40000, 8, 39992, 6, 4),
    (256, 0, 256, 30, 17),  # whole rows (pages of every head at equal TP)
]
BUFFERS = 5


def main() -> None:
    torch.manual_seed(0)
    triton_kernels.warm_up(torch.device("cpu"))  # what registration does on a GPU
    for row_bytes, column, width, buffer_rows, copied in CASES:
        views = [
            torch.randint(0, 256, (buffer_rows, row_bytes), dtype=torch.uint8)
            for _ in range(BUFFERS)
        ]
        rows = torch.randperm(buffer_rows)[:copied]
        size = BUFFERS * copied * width
        expected, staged_bytes = (
            torch.zeros(size, dtype=torch.uint8),
            torch.zeros(size, dtype=torch.uint8),
        )
        torch_kernels.gather(views, rows, column, width, expected)
        word = torch_kernels._word_type([*views, staged_bytes], column, width)
        start, words = column // word.itemsize, width // word.itemsize
        staged = staged_bytes.view(word)
        triton_kernels.gather([v.view(word) for v in views], rows, start, words, staged)
        assert torch.equal(staged_bytes, expected), f"gather {row_bytes, column, width}"

        want = [torch.zeros_like(view) for view in views]
        got = [torch.zeros_like(view) for view in views]
        torch_kernels.scatter(expected, want, rows, column, width)
        triton_kernels.scatter(staged, [view.view(word) for view in got], rows, start, words)
        assert all(map(torch.equal, got, want)), f"scatter {row_bytes, column, width}"
        print(f"row {row_bytes} B, slice [{column}, {column + width}), {copied} rows: {word}")


if __name__ == "__main__":
    main()
