"""Composite parent keys on schemas unlike test_composite_keys.py's: field names lockstep's own SQL uses as
aliases, and the messages of a refused key type."""

from __future__ import annotations

import psycopg
import pytest
from util import result

SCHEMA = """
create table p (a int not null, b int not null, primary key (a, b));
create type p_key as ({f1} int, {f2} int);
create table t (a int not null, b int not null, n int not null, primary key (a, b),
                foreign key (a, b) references p on delete cascade on update cascade);
create function f(keys p_key[]) returns table (a int, b int, n int) language sql stable
    as $$ select p.a, p.b, p.a + p.b from public.p p
          where keys is null or row(p.a, p.b)::public.p_key = any(keys) $$;
insert into p values (1, 1), (2, 2), (3, 3);
"""


@pytest.mark.parametrize(("f1", "f2"), [("k", "id"), ("v", "id"), ("id", "v"), ("id", "k")])
def test_fields_named_like_lockstep_aliases_work(conn, f1, f2):
    """A field named like the alias of an unnest() of keys (k, v) shadowed the whole key: enqueue, verify
    and every worker pass failed."""
    conn.execute(SCHEMA.format(f1=f1, f2=f2))
    conn.execute("select lockstep.define_derived('j', 't', 'f(p_key[])', 'p')")
    assert result(conn, "lockstep.recompute('j')")["outcome"] == "done"
    conn.execute("delete from t where a > 1")
    assert conn.execute(
        "select lockstep.enqueue('j', array[row(2, 2), row(3, 3), row(2, 2)]::p_key[])"
    ).fetchone() == (2,)
    assert conn.execute("select key from lockstep.queue order by id").fetchall() == [("(2,2)",), ("(3,3)",)]
    r = result(conn, "lockstep.work('j')")
    assert (r["outcome"], r["inserted"]) == ("done", 2), r
    assert conn.execute("select missing, extra, different from lockstep.verify('j')").fetchone() == (0, 0, 0)
    conn.execute("update t set n = 0 where a = 3")
    v = conn.execute("select different from lockstep.verify('j', array[row(3, 3)]::p_key[])").fetchone()
    assert v == (1,)
    with pytest.raises(Exception, match="NULL"):
        conn.execute("select lockstep.enqueue('j', array[row(1, null)]::p_key[])")


def test_a_query_defined_job_keyed_by_columns_named_k_and_v_works(conn):
    """A query-defined job's key type takes the parent key's column names as its fields."""
    conn.execute(
        """
        create table qp (k int not null, v int not null, primary key (k, v));
        create table qc (k int not null, v int not null, x int not null);
        create table qt (k int not null, v int not null, n bigint not null, primary key (k, v),
                         foreign key (k, v) references qp on delete cascade);
        insert into qp values (1, 1), (2, 2);
        insert into qc values (1, 1, 5), (2, 2, 7);
        select lockstep.define_derived('qj', 'qt', parent => 'qp', query => $q$
            select p.k, p.v, coalesce(sum(c.x), 0)::bigint as n
            from public.qp p left join public.qc c on c.k = p.k and c.v = p.v group by p.k, p.v $q$);
        select lockstep.watch('qj', 'qc', key_columns => array['k', 'v']::name[]);
        """
    )
    assert result(conn, "lockstep.run('qj')")["outcome"] == "done"
    conn.execute("update qc set x = x + 1")
    r = result(conn, "lockstep.run('qj')")
    assert (r["outcome"], r["updated"]) == ("done", 2), r
    assert conn.execute("select missing, extra, different from lockstep.verify('qj')").fetchone() == (0, 0, 0)


def test_a_refused_key_type_at_define_names_no_empty_job(conn):
    """The refusal of a composite key type with a cast of its own said 'of job ""'."""
    conn.execute(SCHEMA.format(f1="a", f2="b"))
    conn.execute("create cast (p_key as text) with inout")
    with pytest.raises(psycopg.Error, match="cast") as e:
        conn.execute("select lockstep.define_derived('j', 't', 'f(p_key[])', 'p')")
    assert 'job ""' not in str(e.value), e.value


def test_parent_columns_out_of_the_keys_order_are_told_the_order(conn):
    """The target's foreign key covers the parent's key in another order: the hint names parent_columns in
    the key's order (it asked for a second foreign key, as if none referenced the parent)."""
    conn.execute(
        """
        create table p3 (a int, b text, c bigint, primary key (c, a, b));
        create type p3_key as (c bigint, a int, b text);
        create table t3 (a int not null, b text not null, c bigint not null, primary key (a, b, c),
                         foreign key (a, b, c) references p3 (a, b, c) on delete cascade);
        create function f3(keys p3_key[]) returns table (a int, b text, c bigint) language sql stable
            as $$ select p.a, p.b, p.c from public.p3 p where keys is null $$;
        """
    )
    with pytest.raises(psycopg.Error, match="column for column") as e:
        conn.execute(
            "select lockstep.define_derived('j3', 't3', 'f3(p3_key[])', 'p3',"
            " parent_columns => array['a', 'b', 'c']::name[])"
        )
    assert e.value.diag.message_hint == (
        "Name them in the order of public.p3's primary key: parent_columns => array['c', 'a', 'b']::name[]"
    ), e.value.diag.message_hint
    conn.execute(
        "select lockstep.define_derived('j3', 't3', 'f3(p3_key[])', 'p3',"
        " parent_columns => array['c', 'a', 'b']::name[])"
    )
