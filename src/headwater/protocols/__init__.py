"""Wire protocol codecs: pure (sans-I/O) encoders, decoders and connection state machines.

Nothing in this package touches sockets or an event loop; the server and the clients feed
bytes in and write the bytes these codecs hand back.
"""
