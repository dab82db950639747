"""Where bytes live: locations (local disk, S3, memory), blob stores, storage limits and retries, and the
packed part files read and written beside Zarr. Imports `logitstore.format` and the ground floor."""
