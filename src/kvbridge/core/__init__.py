"""The protocol's pure core above the wire and the cache geometry: per-room state, liveness,
and each side's protocol, with no sockets, no threads and no clock reads (time comes in with
every event). The managers in `kvbridge.prefill` and `kvbridge.decode` are shells around it.
"""
