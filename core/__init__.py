"""The ground floor: recipes (config), storage, manifests, stage bookkeeping, retries, tensor io, rejects,
locks and progress. It imports nothing of the floors above it."""
