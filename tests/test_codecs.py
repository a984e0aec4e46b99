"""Codecs against a float64 reference: bounds per encode, edge sizes, bad input, error feedback."""

from __future__ import annotations

import pytest
import torch

from isthmus.deploy.bench.codec import pseudo_gradient
from isthmus.inter.codecs import (
    Codec,
    CodecError,
    ErrorFeedback,
    byte_shuffle,
    byte_unshuffle,
    parse_codec,
)

SPECS = [
    *("none", "fp16", "bf16", "int8", "int4", "int2"),
    *("none+zstd", "bf16+zstd", "int8+zstd", "int4+zstd", "int2+zstd"),
]


@pytest.fixture(scope="module")
def real_pseudo_gradient() -> torch.Tensor:
    return pseudo_gradient(steps=5)


def _data(kind: str, n: int = 50_001) -> torch.Tensor:
    generator = torch.Generator().manual_seed(7)
    if kind == "normal":
        return torch.randn(n, generator=generator)
    if kind == "heavy":  # Cauchy-like: huge outliers next to tiny values
        u = torch.rand(n, generator=generator)
        return torch.tan(torch.pi * (u - 0.5)).clamp(-6e4, 6e4)
    if kind == "tiny":
        return torch.randn(n, generator=generator) * 1e-6
    raise ValueError(kind)


def _check_bound(codec: Codec, values: torch.Tensor) -> None:
    decoded = codec.decode(codec.encode(values))
    assert decoded.dtype == torch.float32 and decoded.shape == values.shape
    error = (decoded.double() - values.double()).abs()
    bound = codec.max_error(values)
    assert torch.all(error <= bound), float((error - bound).max())


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("kind", ["normal", "heavy", "tiny"])
def test_error_within_the_stated_bound(spec, kind):
    _check_bound(parse_codec(spec), _data(kind))


@pytest.mark.parametrize("spec", SPECS)
def test_error_bound_on_a_real_pseudo_gradient(spec, real_pseudo_gradient):
    _check_bound(parse_codec(spec), real_pseudo_gradient)


def test_int_bounds_are_the_documented_fractions_of_block_absmax():
    values = _data("normal", 4096)
    for spec, levels in (("int8", 254), ("int4", 14), ("int2", 2)):
        codec = parse_codec(spec, block_size=64)
        decoded = codec.decode(codec.encode(values))
        blocks = values.view(-1, 64)
        absmax = blocks.abs().amax(dim=1, keepdim=True)
        error = (decoded.view(-1, 64) - blocks).abs()
        assert torch.all(error <= absmax / levels * (1 + 1e-6))


def test_none_is_exact():
    values = _data("heavy")
    assert torch.equal(
        parse_codec("none+zstd").decode(parse_codec("none+zstd").encode(values)), values
    )


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("n", [0, 1, 2, 255, 257, 1023])
def test_odd_sizes_round_trip(spec, n):
    codec = parse_codec(spec, block_size=256)
    values = torch.linspace(-3, 3, n)
    decoded = codec.decode(codec.encode(values))
    assert decoded.shape == (n,)
    if n:
        assert torch.all((decoded.double() - values.double()).abs() <= codec.max_error(values))


def test_decode_into_a_reused_buffer():
    codec = parse_codec("int8")
    encoded = codec.encode(_data("normal", 1000))
    out = torch.full((1000,), float("nan"))
    result = codec.decode(encoded, out=out)
    assert result.data_ptr() == out.data_ptr()
    assert torch.equal(out, codec.decode(encoded))
    with pytest.raises(CodecError, match="out must be float32 with 1000 values"):
        codec.decode(encoded, out=torch.empty(999))


def test_compression_ratios():
    values = _data("normal", 1 << 16)
    sizes = {spec: len(parse_codec(spec).encode(values).payload) for spec in SPECS}
    assert sizes["none"] == 4 << 16
    assert sizes["fp16"] == sizes["bf16"] == 2 << 16
    assert sizes["int8"] == (1 << 16) + 4 * (1 << 16) // 256
    assert sizes["int4"] == (1 << 15) + 4 * (1 << 16) // 256
    assert sizes["int2"] == (1 << 14) + 4 * (1 << 16) // 256


def test_int2_sends_zero_or_the_blocks_absmax_with_its_sign():
    values = torch.tensor([0.9, -0.2, 0.49, -0.51, 0.0, -1.0, 0.3, 0.6])
    codec = parse_codec("int2", block_size=4)
    decoded = codec.decode(codec.encode(values))
    assert decoded.tolist() == pytest.approx([0.9, 0.0, 0.9, -0.9, 0.0, -1.0, 0.0, 1.0])


def test_bf16_zstd_compresses_a_real_pseudo_gradient(real_pseudo_gradient):
    plain = len(parse_codec("bf16").encode(real_pseudo_gradient).payload)
    packed = len(parse_codec("bf16+zstd").encode(real_pseudo_gradient).payload)
    assert packed < plain


def test_byte_shuffle_round_trips():
    data = bytes(range(256)) * 8
    for element in (1, 2, 4):
        assert byte_unshuffle(byte_shuffle(data, element), element) == data
    assert byte_shuffle(b"\x01\x02\x03\x04", 2) == b"\x01\x03\x02\x04"


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: Codec(name="int3"), "unknown codec 'int3'"),
        (lambda: Codec(name="int4", block_size=7), "block_size must be an even integer"),
        (lambda: Codec(name="int2", block_size=6), "a multiple of 4 for int2"),
        (lambda: Codec(name="int8", zstd=True, zstd_level=40), "zstd_level must be in"),
        (lambda: parse_codec("int8+lz4"), "unknown lossless stage 'lz4'"),
        (lambda: parse_codec("fp16").encode(torch.tensor([1e5])), "exceeds fp16's range"),
        (
            lambda: parse_codec("int8").encode(torch.ones(3, dtype=torch.float64)),
            "expected float32",
        ),
        (lambda: parse_codec("int8").encode([1.0, 2.0]), "expected a torch.Tensor"),
        (
            lambda: parse_codec("int8").decode(parse_codec("int4").encode(torch.ones(4))),
            "encoded with 'int4'",
        ),
    ],
)
def test_bad_input_is_refused_with_the_reason(make, message):
    with pytest.raises(CodecError, match=message):
        make()


def test_a_truncated_payload_is_refused():
    codec = parse_codec("bf16")
    encoded = codec.encode(torch.ones(100))
    broken = type(encoded)(encoded.codec, encoded.count, encoded.payload[:-2], 0, encoded.meta)
    with pytest.raises(CodecError, match="value bytes, expected"):
        codec.decode(broken)


def test_error_feedback_keeps_the_running_sum_unbiased():
    # The same small tensor sent every round: int4 alone loses its small values
    # every time; with the residual carried over, the sum of what was sent stays
    # within one quantisation step of the true sum.
    codec = parse_codec("int4", block_size=64)
    values = torch.linspace(-0.01, 0.01, 64)
    values[0] = 1.0  # one large value makes the block's step coarse
    feedback = ErrorFeedback(codec)
    sent_plain = torch.zeros(64, dtype=torch.float64)
    sent_feedback = torch.zeros(64, dtype=torch.float64)
    rounds = 200
    for _ in range(rounds):
        sent_plain += codec.decode(codec.encode(values)).double()
        sent_feedback += codec.decode(feedback.encode(values)).double()
    truth = values.double() * rounds
    step = 1.0 / 7
    assert (sent_feedback - truth).abs().max() <= step
    assert (sent_plain - truth).abs().max() > 5 * step
