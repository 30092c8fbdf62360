#!lua name=imgserve
-- The job's life in one Redis function library (contract.library loads it: the files in its FILES order, as one
-- source). Every step is a function registered below its local helpers; a helper reads its keys and arguments
-- from the `keys` and `args` it is given, at the positions its step's comment names.

-- The library's version: a process loads this library over a loaded one only when its own is newer
-- (contract.library.ensure_library). Raise it with any change to a file of the library.
local VERSION = 10

-- Numbers: a numeric string the steps wrote themselves (an argument the caller formatted, a count kept with HINCRBY, a
-- moment written as repr(float)) becomes a number by arithmetic (`s + 0`), which parses it once; `tonumber` is a C
-- call that parses it twice (Lua 5.1's lua_isnumber, then lua_tonumber; what that costs is in
-- docs/benchmarks/2026-12-07-plane-cuts.md, round four). `tonumber` stays where a value may be anything else (it
-- answers nil there, where arithmetic raises).

-- A job's terminal states (contract.jobs.record.TERMINAL; a test holds the two together).
local TERMINAL = {cancelled = true, expired = true, failed = true, succeeded = true}
-- The live ones (contract.jobs.record.JobStatus), as the steps name them.
local QUEUED, PREPROCESSING, QUEUED_GPU, RUNNING = 'queued', 'preprocessing', 'queued_gpu', 'running'

redis.register_function{function_name = 'imgserve_version', callback = function() return VERSION end,
                        flags = {'no-writes'}}
