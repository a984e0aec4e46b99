"""The sparse codec (``topk``): what it sends, its bound, its bytes, its settings."""

from __future__ import annotations

import math

import pytest
import torch

from isthmus.inter.chunks import encode_chunks, to_encoded, values_per_chunk, verify
from isthmus.inter.codecs import Codec, CodecError, ErrorFeedback, parse_codec
from isthmus.job.compressor import SparseSettings
from isthmus.job.settings import SettingError, TrainSettings


def _values(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("spec", ["topk", "topk:bits=4,chunk=256,density=0.1", "topk+zstd"])
@pytest.mark.parametrize("n", [1, 10, 255, 4096, 10_007])
def test_it_sends_each_chunk_s_largest_values_within_the_bound(spec, n):
    codec = parse_codec(spec)
    settings = codec.sparse
    x = _values(n)
    decoded = codec.decode(codec.encode(x))
    assert decoded.shape == x.shape
    assert torch.all((decoded.double() - x.double()).abs() <= codec.max_error(x))
    # Per chunk, exactly the k values of largest magnitude are sent (none is zero:
    # the levels are mid-rise), and nothing else.
    for start in range(0, n, settings.chunk):
        part, got = x[start : start + settings.chunk], decoded[start : start + settings.chunk]
        k = min(settings.per_chunk, part.numel())
        sent = set(torch.nonzero(got).view(-1).tolist())
        assert sent == set(part.abs().topk(k).indices.tolist())


def test_a_sent_value_is_off_by_at_most_half_a_step():
    # 2 bits: four levels, step = absmax / 1.5, so |error| <= absmax / 3; 4 bits: / 15.
    x = _values(4096, seed=3)
    for bits, parts in ((2, 3), (4, 15)):
        codec = parse_codec(f"topk:bits={bits},density=1.0,chunk=4096")
        error = (codec.decode(codec.encode(x)) - x).abs().max().item()
        assert error <= x.abs().max().item() / parts * (1 + 1e-6)
        assert error > x.abs().max().item() / parts / 4  # the bound is not loose by far


def test_zeros_and_ties_decode_to_zeros_and_sent_values():
    codec = parse_codec("topk:chunk=256,density=0.05")
    zeros = torch.zeros(1000)
    assert torch.equal(codec.decode(codec.encode(zeros)), zeros)
    ties = torch.ones(256)  # every value the largest: the first k are sent, exactly
    decoded = codec.decode(codec.encode(ties))
    k = codec.sparse.per_chunk
    assert torch.equal(decoded, torch.cat((torch.ones(k), torch.zeros(256 - k))))


@pytest.mark.parametrize("spec", ["topk", "topk:bits=4,chunk=1024,density=0.01"])
def test_the_payload_is_the_stated_bytes_per_value(spec):
    codec = parse_codec(spec)
    n = 64 * codec.sparse.chunk
    payload = len(bytes(codec.encode(_values(n)).payload))
    assert payload == math.ceil(codec.bytes_per_value() * n)
    # 2% of 4096 with 2-bit values: 82 positions of 12 bits and 82 values of 2 bits
    # and a float32 step per 4,096 values: 0.036 bytes a value, 111x below float32.
    if spec == "topk":
        assert codec.bytes_per_value() == pytest.approx((82 * 14 / 8 + 4) / 4096)


def test_a_chunk_crosses_the_wire_with_its_settings_in_the_codec_string():
    codec = parse_codec("topk:bits=4,chunk=512,density=0.05+zstd")
    x = _values(20_000)
    chunks = list(encode_chunks(codec, x, round=0, shard=0, max_chunk_bytes=4096))
    assert len(chunks) > 1  # sized for the densest result: every value of a chunk
    assert values_per_chunk(codec, 4096) % 512 == 0
    out, at = torch.empty_like(x), 0
    for chunk in chunks:
        assert chunk.codec == "topk:bits=4,chunk=512,density=0.05+zstd"
        received = verify(chunk, chunk.payload)  # the receiver's codec, from the chunk
        assert received == codec
        part = received.decode(to_encoded(chunk, chunk.payload))
        out[at : at + part.numel()] = part
        at += part.numel()
    assert at == x.numel()
    assert torch.all((out.double() - x.double()).abs() <= codec.max_error(x))


def test_an_owner_s_result_carries_the_union_of_the_sites_positions():
    codec = parse_codec("topk:chunk=256,density=0.03")
    k = codec.sparse.per_chunk
    contributions = [codec.decode(codec.encode(_values(256, seed=s))) for s in range(4)]
    total = sum(contributions) / 4
    union = set(torch.nonzero(total).view(-1).tolist())
    assert len(union) > k  # the sites chose different positions
    result = codec.for_sum_of(4)
    assert result.sparse.per_chunk == 4 * k and result.sparse.bits == 4
    decoded = result.decode(result.encode(total))
    assert set(torch.nonzero(decoded).view(-1).tolist()) >= union
    assert torch.all((decoded.double() - total.double()).abs() <= result.max_error(total))
    assert codec.for_sum_of(1) is codec
    assert codec.for_sum_of(1000).sparse.density == 1.0
    assert parse_codec("int8").for_sum_of(4) == parse_codec("int8")


def test_with_error_feedback_what_is_not_sent_goes_in_later_rounds():
    # The same vector sent 200 times: without feedback 98% of it never goes; with
    # it, the sum of what was sent follows the sum of the values (off by what the
    # residual holds, which does not grow with the rounds).
    codec = parse_codec("topk:chunk=256,density=0.02")
    x = _values(2560, seed=1)
    feedback = ErrorFeedback(codec)
    sent_plain = sum(codec.decode(codec.encode(x)) for _ in range(200))
    sent_fed = sum(codec.decode(feedback.encode(x)) for _ in range(200))
    truth = 200 * x
    plain_error = (sent_plain - truth).norm() / truth.norm()
    fed_error = (sent_fed - truth).norm() / truth.norm()
    assert plain_error > 0.9
    assert fed_error < 0.25 * plain_error, (fed_error, plain_error)


def test_the_job_file_s_compressor_settings_become_the_codec_string():
    settings = TrainSettings(
        codec="topk+zstd", compressor={"density": 0.01, "bits": 4}, error_feedback=True
    )
    assert settings.codec == "topk:bits=4,chunk=4096,density=0.01+zstd"
    assert settings.compressor is None
    # Checked again (a run directory's settings, a live change): the same string.
    assert TrainSettings(codec=settings.codec, error_feedback=True).codec == settings.codec
    default = TrainSettings(codec="topk", error_feedback=True).codec
    assert default == SparseSettings().spec() == parse_codec("topk").spec


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"compressor": {"density": 0}}, "compressor.density: must be a share in (0, 1]"),
        ({"compressor": {"density": 1.5}}, "compressor.density: must be a share in (0, 1]"),
        ({"compressor": {"density": "2%"}}, "compressor.density: must be a share"),
        ({"compressor": {"bits": 3}}, "compressor.bits: the topk codec offers 2 or 4-bit"),
        ({"compressor": {"bits": True}}, "compressor.bits: the topk codec offers"),
        ({"compressor": {"chunk": 1000}}, "compressor.chunk: must be a power of two"),
        ({"compressor": {"chunk": 128}}, "compressor.chunk: must be a power of two"),
        ({"compressor": {"top_k": 0.1}}, "compressor.top_k: unknown setting; the topk codec"),
        ({"compressor": {"feedback_decay": 0}}, "compressor.feedback_decay: must be in (0, 1]"),
        ({"compressor": {"feedback_decay": 1.2}}, "compressor.feedback_decay: must be in (0, 1]"),
        ({"compressor": [0.1]}, "compressor: must be a mapping"),
        ({"codec": "int8", "compressor": {"density": 0.1}}, "set codec: topk, or remove"),
        ({"codec": "topk:bits=2", "compressor": {"bits": 2}}, "give them in one place"),
        ({"codec": "topk:bits=8"}, "compressor.bits: the topk codec offers"),
        ({"codec": "topk:rate=0.1"}, "codec: 'rate=0.1' in 'topk:rate=0.1': write key=value"),
        ({"codec": "topk:density=x"}, "is not a number"),
        ({"codec": "topk+gzip"}, "codec: unknown codec"),
        ({"error_feedback": False}, "error_feedback: codec topk sends only the largest"),
    ],
)
def test_bad_compressor_settings_are_refused_naming_the_field(fields, message):
    fields = {"codec": "topk", "error_feedback": True, **fields}
    with pytest.raises(SettingError) as refused:
        TrainSettings(**fields)
    assert message in str(refused.value)


def test_bad_codec_strings_are_refused_by_the_codec_too():
    with pytest.raises(CodecError, match="offers 2 or 4-bit"):
        parse_codec("topk:bits=3")
    with pytest.raises(CodecError, match="sparse settings are the topk codec's"):
        Codec(name="int8", sparse=SparseSettings())
    # The wire: a payload whose size does not match its settings is refused.
    codec = parse_codec("topk:chunk=256")
    encoded = codec.encode(_values(512))
    other = parse_codec("topk:chunk=256,density=0.5")
    with pytest.raises(CodecError):
        other.decode(type(encoded)(**{**encoded.__dict__, "codec": other.spec}))


def test_feedback_decay_rides_in_the_codec_string_and_decays_the_residual():
    from isthmus.inter.allreduce.feedback import ErrorFeedback as EngineFeedback

    settings = TrainSettings(
        codec="topk", compressor={"feedback_decay": 0.95}, error_feedback=True, outer_momentum=0
    )
    assert settings.codec == "topk:bits=2,chunk=4096,density=0.02,feedback_decay=0.95"
    codec = parse_codec(settings.codec)
    assert codec.sparse.feedback_decay == 0.95 and codec.for_sum_of(3).sparse.feedback_decay == 0.95
    # The engine's feedback: this round's contribution is the values plus 0.95 of the
    # residual; with the default (1) the residual itself.
    feedback = EngineFeedback()
    feedback.keep("model", torch.ones(4))
    values = torch.full((4,), 2.0)
    assert torch.equal(feedback.begin("model", values, codec, counted=True)[0], values + 0.95)
    plain = parse_codec("topk")
    assert torch.equal(feedback.begin("model", values, plain, counted=True)[0], values + 1)
