"""Transport settings: both ends agree, and bad values are refused."""

import pytest

from isthmus.inter.transport import TransportSettings


def test_both_ends_agree_on_message_size_and_keepalive():
    settings = TransportSettings(max_chunk_bytes=8 << 20, keepalive_s=20)
    client = dict(settings.channel_options())
    server = dict(settings.server_options())
    # The server lets in up to twice what a client may send, to refuse it by name.
    assert client["grpc.max_send_message_length"] == settings.max_message_bytes
    assert server["grpc.max_receive_message_length"] == 2 * settings.max_message_bytes
    assert client["grpc.max_send_message_length"] > 8 << 20
    # The server must accept pings at the rate the client sends them.
    assert (
        server["grpc.http2.min_recv_ping_interval_without_data_ms"]
        <= client["grpc.keepalive_time_ms"]
    )
    # ... and never close a connection for pings (BDP probes between rounds).
    assert server["grpc.http2.max_ping_strikes"] == 0
    assert server["grpc.so_reuseport"] == 0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_chunk_bytes": 10}, "max_chunk_bytes"),
        ({"max_chunk_bytes": 1 << 30}, "max_chunk_bytes"),
        ({"stream_window_bytes": 10}, "stream_window_bytes"),
        ({"keepalive_s": 0}, "keepalive"),
    ],
)
def test_bad_settings_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        TransportSettings(**kwargs)


def test_a_peer_restarted_at_a_new_address_is_looked_up_again_within_a_second():
    """gRPC's default waits 30 s between lookups of a name: a restarted container
    behind the same name was dialled at its old address for a whole round deadline
    (tests/test_containers.py kills and restarts one)."""
    client = dict(TransportSettings().channel_options())
    assert client["grpc.dns_min_time_between_resolutions_ms"] <= 1000
