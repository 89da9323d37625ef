"""``GroupCommit`` on its own: items whose key is already in a batch either wait for the next
batch (no ``follow``: finalizes) or ride along and get the answer ``follow`` makes of the
first one's (reserves). The statement itself is a recording function here; the store's own
tests (``test_group_commit.py``) run the same batches on PostgreSQL."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest

from idempotency_gateway.errors import StoreUnavailable
from idempotency_gateway.storage.group_commit import GroupCommit

Item = tuple[str, str]  # (key, who)


class Statements:
    """Answers each item with ``answered:<key>:<who>``, or the error set for its key, and
    records the items of every statement."""

    def __init__(self) -> None:
        self.sent: list[list[Item]] = []
        self.fail_key: str | None = None
        self.fail_all = False

    async def run(self, items: Sequence[Item]) -> list[str | StoreUnavailable]:
        self.sent.append(list(items))
        await asyncio.sleep(0)  # an answer comes back in a later iteration, as a reply would
        if self.fail_all:
            raise StoreUnavailable("the batch failed")
        return [
            StoreUnavailable(f"no row for {key}")
            if key == self.fail_key
            else f"answered:{key}:{who}"
            for key, who in items
        ]


def following(item: Item, first: str) -> str:
    return f"{item[1]} after {first}"


def batching(
    statements: Statements, *, follow: bool, max_batch: int = 64
) -> GroupCommit[Item, str]:
    return GroupCommit(
        statements.run,
        key=lambda item: item[0],
        max_batch=max_batch,
        follow=following if follow else None,
    )


async def test_a_burst_of_one_key_is_one_statement_and_each_follower_gets_its_own_answer() -> None:
    statements = Statements()
    commit = batching(statements, follow=True)
    items = [("k", "a"), ("other", "x"), ("k", "b"), ("k", "c"), ("third", "y")]
    answers = await asyncio.gather(*(commit.submit(item) for item in items))
    assert statements.sent == [[("k", "a"), ("other", "x"), ("third", "y")]]
    assert answers == [
        "answered:k:a",
        "answered:other:x",
        "b after answered:k:a",
        "c after answered:k:a",
        "answered:third:y",
    ]


async def test_without_follow_the_same_key_waits_for_the_next_statement() -> None:
    statements = Statements()
    commit = batching(statements, follow=False)
    answers = await asyncio.gather(*(commit.submit(item) for item in [("k", "a"), ("k", "b")]))
    assert statements.sent == [[("k", "a")], [("k", "b")]]
    assert answers == ["answered:k:a", "answered:k:b"]


async def test_followers_do_not_count_against_the_batch_size() -> None:
    statements = Statements()
    commit = batching(statements, follow=True, max_batch=2)
    items = [("k", "a"), ("k", "b"), ("k", "c"), ("other", "x"), ("third", "y")]
    answers = await asyncio.gather(*(commit.submit(item) for item in items))
    assert statements.sent == [[("k", "a"), ("other", "x")], [("third", "y")]]
    assert answers[1:3] == ["b after answered:k:a", "c after answered:k:a"]


async def test_a_first_item_that_failed_fails_its_followers_each_with_an_error_of_its_own() -> None:
    statements = Statements()
    statements.fail_key = "k"
    commit = batching(statements, follow=True)
    results = await asyncio.gather(
        *(commit.submit(item) for item in [("k", "a"), ("k", "b"), ("other", "x")]),
        return_exceptions=True,
    )
    first, second, other = results
    assert isinstance(first, StoreUnavailable)
    assert isinstance(second, StoreUnavailable)
    assert first is not second  # one shared instance would gather every caller's traceback
    assert other == "answered:other:x"


async def test_a_failed_statement_fails_its_followers_too() -> None:
    statements = Statements()
    statements.fail_all = True
    commit = batching(statements, follow=True)
    for outcome in asyncio.as_completed([commit.submit(("k", "a")), commit.submit(("k", "b"))]):
        with pytest.raises(StoreUnavailable):
            await outcome
    assert len(statements.sent) == 1


async def test_when_the_first_caller_is_cancelled_before_the_statement_a_follower_leads() -> None:
    statements = Statements()
    commit = batching(statements, follow=True)
    first = asyncio.ensure_future(commit.submit(("k", "a")))
    second = asyncio.ensure_future(commit.submit(("k", "b")))
    third = asyncio.ensure_future(commit.submit(("k", "c")))
    # One turn of the loop: all three submit; the statement is taken in the turn after.
    await asyncio.sleep(0)
    first.cancel()  # its future is done at once, before the statement is taken
    assert list(await asyncio.gather(second, third)) == ["answered:k:b", "c after answered:k:b"]
    assert first.cancelled()
    assert statements.sent == [[("k", "b")]]


async def test_a_statement_answering_the_wrong_count_fails_every_caller_instead_of_hanging() -> (
    None
):
    async def one_answer_short(items: Sequence[Item]) -> list[str | StoreUnavailable]:
        answers: list[str | StoreUnavailable] = [f"answered:{key}:{who}" for key, who in items]
        return answers[1:]

    commit: GroupCommit[Item, str] = GroupCommit(
        one_answer_short, key=lambda item: item[0], max_batch=64, follow=following
    )
    async with asyncio.timeout(10):  # a bound for a failing test, not a wait this one needs
        results = await asyncio.gather(
            *(commit.submit(item) for item in [("k", "a"), ("k", "b"), ("other", "x")]),
            return_exceptions=True,
        )
    # Nobody got an answer, least of all the one that was another's.
    assert all(isinstance(result, RuntimeError) for result in results)
