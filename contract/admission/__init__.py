"""What the API checks and counts before it takes a job, and what the CPU worker gives back.

- `media`: the image types accepted, told by their first bytes (the API's sniff, the CPU worker's decoder).
- `budget`: the admission step in Redis: a model's backlog and the bytes waiting, against budgets (`BudgetVerdict`).
- `token_bucket`: the rate limit's bucket per API key, and per address for failed authentications.
- `decode_share`: an upload's decode cost from its header, and each API key's expensive decodes in flight (the API
  charges, the CPU worker gives back).

`budget` and `token_bucket` are the API's alone, yet live here: each is the Python side of a library step
(library/budget.lua, library/token_bucket.lua), whose argument positions stay beside the other steps', and
contract.jobs.intake runs the budget's admission inside its own step.
"""
