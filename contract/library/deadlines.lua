
-- contract.deadlines' judgement inside a step: `now` is an argument the caller read from the service's clock.
local function deadline_passed(deadline, now)
  return deadline ~= nil and tonumber(now) > deadline
end
