"""Where bytes live: locations (local disk, S3, memory), blob stores, storage limits and retries, and the
packed part files read and written beside Zarr. Imports `logitstore.format` and the ground floor."""

from numcodecs import blosc

# Blosc through its context functions: logitstore compresses and decompresses chunks in threads of its own
# (`rawwrite`, `rawread`, Zarr's codec threads). With numcodecs' default those calls can take turns on one
# global lock: two threads compressed a part's chunks no faster than one here (39 ms either way), where
# with this they ran at once (21 ms). Blosc's own threads inside one call gained ~20% of a core at most.
blosc.use_threads = False
