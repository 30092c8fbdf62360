"""The contract the API, the CPU workers and the GPU worker share.

- `settings`: every setting, from YAML.
- `keys`: every Redis key and channel.
- `jobs`: job states, the record in Redis and its public JSON.
- `frames`: the binary frame on the GPU list.
- `timebill`: the stages of a request's life and their durations.
- `connection`: how each process opens Redis.
"""
