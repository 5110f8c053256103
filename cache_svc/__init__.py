"""The cache service (DESIGN §6): snapshots on disk behind a gRPC API; the wire limits both ends share."""

# Snapshot bytes travel in chunks of this size; the message limit leaves room for a header carrying the
# token ids of a long conversation (4 bytes a token).
CHUNK_BYTES = 2 * 1024 * 1024
MAX_MESSAGE_BYTES = 16 * 1024 * 1024
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]
