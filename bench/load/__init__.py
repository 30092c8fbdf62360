"""A deployment under load over real HTTP: the client (`client`: open and closed loops, long-polls), one measured
run (`runs`), its report and charts, and what builds on them: two builds alternating (`ab`), tune, diagnose (with
the runbook it points at), burst, the reads' cost, and the synchronous peer. Imports the stack and meters wings."""
