"""The batched engine-step calls (create, admit, resume, resize, commit, close
many caches at once) against the per-cache calls, and the step benchmark's
drivers."""
