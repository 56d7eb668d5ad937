"""Model code over the paged KV cache. Imports no block manager and no scheduler."""
