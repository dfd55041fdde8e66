"""The KV tiers under the device pools: bookkeeping, host and disk stores, copies and their threads."""
