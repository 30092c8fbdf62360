"""The "before" of the story: one synchronous process that does everything in
the request thread, one request at a time. It exists so every bench report can
show before and after on the same machine with the same model code."""
