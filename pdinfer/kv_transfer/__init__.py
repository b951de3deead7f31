"""Moving a request and its KV cache from a prefill engine (PE) to a completion engine (CE).

Messages are typed msgspec structs (msgpack) plus raw tensor bytes; nothing is ever unpickled.
"""
