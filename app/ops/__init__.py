"""Operations: metrics, structured request logs, the admin listener, the sweeper."""
