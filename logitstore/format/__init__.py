"""What is stored and how it is encoded: samples, the value grid and codec, sparsity settings, the Zarr
codec and the names of stored arrays (the layout). Imports only the package's ground floor."""
