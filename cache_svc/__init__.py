"""The cache service (DESIGN §6): snapshots on disk behind a gRPC API."""

# Snapshot bytes travel in chunks of this size, far below protos.rpc.MAX_MESSAGE_BYTES: the limit leaves
# room for a header carrying the token ids of a long conversation (4 bytes a token).
CHUNK_BYTES = 2 * 1024 * 1024
