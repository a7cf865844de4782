"""Jobs defined by a query: define_derived(..., query => 'select ...') writes the keyed compute function,
keeps the target current like a function-defined job, warns when a few keys still read a whole table,
and refuses what does not fit at define time, changing nothing."""

from __future__ import annotations

import psycopg
import pytest
import sqlalchemy.exc
from util import drain, raises_sqlstate

from lockstep.migrate import migrate

SHOP = """
create schema shop;
create table shop.customer (id bigint primary key, name text not null);
create table shop.orders (id bigint primary key,
                          customer_id bigint not null references shop.customer (id) on delete cascade);
create index on shop.orders (customer_id);
create table shop.order_line (id bigint primary key,
                              order_id bigint not null references shop.orders (id) on delete cascade,
                              amount integer not null);
create table shop.customer_total (
    customer_id bigint primary key references shop.customer (id) on delete cascade,
    total bigint not null, lines bigint not null);
insert into shop.customer select g, 'c' || g from generate_series(1, 50) g;
insert into shop.orders select g, 1 + g % 50 from generate_series(1, 200) g;
insert into shop.order_line select g, 1 + g % 200, g % 17 from generate_series(1, 2000) g;
analyze shop.customer, shop.orders, shop.order_line;
"""

QUERY = """
    select c.id as customer_id, coalesce(sum(l.amount), 0)::bigint as total, count(l.id) as lines
    from customer c left join orders o on o.customer_id = c.id left join order_line l on l.order_id = o.id
    group by c.id
"""

FN = "shop.customer_total_lockstep_compute(bigint[])"
DIVERGENCE = f"""
select count(*) from (
    (select * from shop.customer_total except select * from {FN.replace("(bigint[])", "(null)")})
    union all
    (select * from {FN.replace("(bigint[])", "(null)")} except select * from shop.customer_total)) d
"""


@pytest.fixture
def shop(conn: psycopg.Connection) -> psycopg.Connection:
    conn.execute(SHOP)
    conn.execute("set search_path = shop, public")
    return conn


def define(conn: psycopg.Connection, query: str = QUERY, **extra: str) -> list[str]:
    notices: list[str] = []
    conn.add_notice_handler(lambda d: notices.append(d.message_primary or ""))
    args = "".join(f", {k} => {v}" for k, v in extra.items())
    conn.execute(
        "select lockstep.define_derived('totals', 'shop.customer_total', query => %s,"
        f" parent => 'shop.customer'{args})",
        [query],
    )
    return notices


def test_a_query_defined_job_keeps_its_target_current(shop: psycopg.Connection) -> None:
    notices = define(shop, query=QUERY.replace("left join order_line l", "left join order_line l"))
    assert shop.execute("select compute from lockstep.job where job = 'totals'").fetchone()[0] == FN
    shop.execute("select lockstep.recompute('totals')")
    assert shop.execute("select count(*) from shop.customer_total").fetchone()[0] == 50
    shop.execute("create index on shop.order_line (order_id)")
    shop.execute("select lockstep.watch('totals', 'orders', 'customer_id')")
    shop.execute(
        "select lockstep.watch('totals', 'order_line', 'order_id',"
        " through => 'orders', through_column => 'customer_id')"
    )
    shop.execute("select lockstep.recompute('totals')")
    shop.execute("update order_line set amount = amount + 5 where order_id in (3, 4)")
    shop.execute("delete from orders where id = 10")
    shop.execute("insert into order_line values (5000, 7, 100)")
    drain(shop, "totals")
    assert shop.execute(DIVERGENCE).fetchone()[0] == 0
    assert any("reads all of shop.order_line" in n for n in notices), notices  # defined before its index


def test_the_key_filter_reaches_the_tables(shop: psycopg.Connection) -> None:
    shop.execute("create index on shop.order_line (order_id)")
    notices = define(shop)
    assert not any("reads all of" in n for n in notices), notices
    rows = shop.execute(
        f"select customer_id from {FN.replace('(bigint[])', '(array[3, 5])')} order by 1"
    ).fetchall()
    assert rows == [(3,), (5,)]
    with shop.transaction():
        shop.execute("set local enable_seqscan = off")
        plan = "\n".join(
            r[0]
            for r in shop.execute(
                "explain select * from (" + QUERY + ") q where q.customer_id = any('{3,5}'::bigint[])"
            )
        )
    assert "Seq Scan" not in plan, plan


def test_a_redefined_query_replaces_the_function_and_drop_job_removes_it(shop: psycopg.Connection) -> None:
    define(shop)
    define(shop, QUERY.replace("count(l.id)", "count(l.id) * 2"))
    shop.execute("select lockstep.recompute('totals')")
    assert shop.execute("select sum(lines) from shop.customer_total").fetchone()[0] == 4000
    shop.execute("select lockstep.drop_job('totals')")
    assert shop.execute("select to_regprocedure(%s)", [FN]).fetchone()[0] is None


BAD = [
    ("select 1 as total", "LSD03", "does not return the parent column customer_id"),
    (QUERY.replace("as lines", "as line_count"), "LSD03", None),
    (QUERY.replace("count(l.id)", "count(l.id) + (random() * 0)::int"), "LSD08", "random()"),
    ("select customer_id frm nowhere", "42601", None),
    ("select customer_id, 1::bigint as total, 1::bigint as lines from nowhere", "42P01", None),
]


@pytest.mark.parametrize(("query", "sqlstate", "match"), BAD)
def test_a_query_that_does_not_fit_is_refused_and_changes_nothing(shop, query, sqlstate, match) -> None:
    with raises_sqlstate(sqlstate, match):
        define(shop, query)
    assert shop.execute("select count(*) from lockstep.job").fetchone()[0] == 0
    assert shop.execute("select to_regprocedure(%s)", [FN]).fetchone()[0] is None


@pytest.mark.parametrize(
    ("query", "message", "hint"),
    [
        (
            QUERY.replace("count(l.id) as lines", "count(l.id)::int as lines"),
            "column lines: the query returns integer, target shop.customer_total has bigint",
            "Cast it: (<expression>)::bigint as lines; or change the type of lines in the target.",
        ),
        (
            QUERY.replace("as lines", "as line_count"),
            "the query returns column line_count, which target shop.customer_total does not have",
            "Name each result column as the target column it fills, or add the column to the target.",
        ),
    ],
)
def test_a_column_that_does_not_fit_is_told_as_the_querys_with_the_fix(shop, query, message, hint) -> None:
    # the message names the query the caller wrote, not the function lockstep wrote from it
    with raises_sqlstate("LSD03") as info:
        define(shop, query)
    assert info.value.diag.message_primary == f"lockstep: {message}"
    assert info.value.diag.message_hint == hint


def test_compute_and_query_are_one_or_the_other(shop: psycopg.Connection) -> None:
    with raises_sqlstate("22004", "must not be NULL together"):
        shop.execute(
            "select lockstep.define_derived('totals', 'shop.customer_total', parent => 'shop.customer')"
        )
    with raises_sqlstate("LSD04", "needs a parent"):
        shop.execute("select lockstep.define_derived('totals', 'shop.customer_total', query => %s)", [QUERY])


def test_a_function_lockstep_did_not_write_is_not_replaced(shop: psycopg.Connection) -> None:
    shop.execute(
        "create function shop.customer_total_lockstep_compute(keys bigint[])"
        " returns table (customer_id bigint)"
        " language sql as 'select 1::bigint'"
    )
    with raises_sqlstate("42723", "lockstep did not write it"):
        define(shop)


def test_two_long_target_names_get_two_compute_functions(shop: psycopg.Connection) -> None:
    """Targets whose names share their first 40 characters got one function name: the second
    define_derived silently replaced the first job's compute, and drop_job of one broke the other."""
    long = "customer_totals_for_the_quarterly_reporting_dashboard"
    for suffix, factor in (("a", 1), ("b", 2)):
        shop.execute(
            f"create table shop.{long}_{suffix} (customer_id bigint primary key"
            " references shop.customer (id) on delete cascade, total bigint not null, lines bigint not null)"
        )
        shop.execute(
            f"select lockstep.define_derived('{suffix}', 'shop.{long}_{suffix}', parent => 'shop.customer',"
            " query => %s)",
            [QUERY.replace("count(l.id)", f"count(l.id) * {factor}")],
        )
    computes = shop.execute("select compute from lockstep.job order by job").fetchall()
    assert len({c for (c,) in computes}) == 2, computes
    assert all(len(c.split(".")[1].split("(")[0]) <= 63 for (c,) in computes), computes
    for job in ("a", "b"):
        assert shop.execute("select outcome from lockstep.recompute(%s)", [job]).fetchone()[0] == "done"
    sums = [shop.execute(f"select sum(lines) from shop.{long}_{s}").fetchone()[0] for s in "ab"]
    assert sums == [2000, 4000]
    shop.execute("select lockstep.drop_job('a')")
    assert shop.execute("select outcome from lockstep.recompute('b')").fetchone()[0] == "done"
    assert shop.execute("select to_regprocedure(%s)", [computes[0][0]]).fetchone()[0] is None
    assert shop.execute("select to_regprocedure(%s)", [computes[1][0]]).fetchone()[0] is not None


def test_a_written_compute_another_job_calls_is_not_replaced(shop: psycopg.Connection) -> None:
    define(shop)
    shop.execute("create table shop.customer_total_copy (like shop.customer_total including all)")
    shop.execute(
        "alter table shop.customer_total_copy add foreign key (customer_id) references shop.customer"
        " on delete cascade"
    )
    shop.execute(
        f"select lockstep.define_derived('copy', 'shop.customer_total_copy', '{FN}', 'shop.customer')"
    )
    with raises_sqlstate("42723", "is the compute of another job"):
        define(shop, QUERY.replace("count(l.id)", "count(l.id) * 2"))
    assert shop.execute("select outcome from lockstep.recompute('copy')").fetchone()[0] == "done"
    assert shop.execute("select sum(lines) from shop.customer_total_copy").fetchone()[0] == 2000


# -- a composite parent key: (tenant_id, id) ---------------------------------------------------------------

TENANTS = """
create schema mt;
create table mt.customer (tenant_id int not null, id bigint not null, primary key (tenant_id, id));
create table mt.orders (tenant_id int not null, id bigint not null, customer_id bigint not null,
                        amount integer not null, primary key (tenant_id, id),
                        foreign key (tenant_id, customer_id) references mt.customer on delete cascade);
create index on mt.orders (tenant_id, customer_id);
create table mt.customer_total (tenant_id int not null, customer_id bigint not null, total bigint not null,
                                orders bigint not null, primary key (tenant_id, customer_id),
                                foreign key (tenant_id, customer_id) references mt.customer
                                    on delete cascade);
insert into mt.customer select t, g from generate_series(1, 4) t, generate_series(1, 500) g;
insert into mt.orders select 1 + g % 4, g, 1 + g % 500, g % 13 from generate_series(1, 20000) g;
analyze mt.customer, mt.orders;
"""
MT_QUERY = """
    select c.tenant_id, c.id as customer_id, coalesce(sum(o.amount), 0)::bigint as total,
           count(o.id) as orders
    from mt.customer c left join mt.orders o on o.tenant_id = c.tenant_id and o.customer_id = c.id
    group by c.tenant_id, c.id
"""
MT_FN = "mt.customer_total_lockstep_compute"
MT_KEY = "mt.customer_total_lockstep_key"


@pytest.fixture
def mt(conn: psycopg.Connection) -> psycopg.Connection:
    conn.execute(TENANTS)
    return conn


def define_mt(conn: psycopg.Connection, query: str = MT_QUERY) -> list[str]:
    notices: list[str] = []
    conn.add_notice_handler(lambda d: notices.append(d.message_primary or ""))
    conn.execute(
        "select lockstep.define_derived('mt_totals', 'mt.customer_total', query => %s,"
        " parent => 'mt.customer')",
        [query],
    )
    return notices


def test_a_query_defined_job_with_a_composite_key_keeps_its_target_current(mt):
    notices = define_mt(mt)
    assert not any("reads all of" in n for n in notices), notices
    job = mt.execute("select key_type::text, parent_columns, compute from lockstep.job").fetchone()
    assert job == (MT_KEY, ["tenant_id", "customer_id"], f"{MT_FN}({MT_KEY}[])")
    fields = mt.execute(
        "select array_agg(attname::text || ' ' || format_type(atttypid, null) order by attnum)"
        " from pg_attribute"
        f" where attrelid = (select typrelid from pg_type where oid = '{MT_KEY}'::regtype) and attnum > 0"
    ).fetchone()[0]
    assert fields == ["tenant_id integer", "id bigint"]  # the parent's key columns
    mt.execute("select lockstep.recompute('mt_totals')")
    drain(mt, "mt_totals")  # the recompute's batches after the first are handed to the worker
    assert mt.execute("select count(*) from mt.customer_total").fetchone()[0] == 2000
    mt.execute(
        "select lockstep.watch('mt_totals', 'mt.orders',"
        " key_columns => array['tenant_id', 'customer_id']::name[])"
    )
    mt.execute("update mt.orders set amount = amount + 5 where tenant_id = 2 and id < 400")
    mt.execute("update mt.orders set customer_id = 9 where tenant_id = 3 and id = 7")  # moved: both customers
    mt.execute("delete from mt.orders where tenant_id = 1 and customer_id = 4")
    drain(mt, "mt_totals")
    divergence = mt.execute(
        f"select count(*) from ((select * from mt.customer_total except select * from {MT_FN}(null))"
        f" union all (select * from {MT_FN}(null) except select * from mt.customer_total)) d"
    ).fetchone()[0]
    assert divergence == 0
    rows = mt.execute(
        f"select tenant_id, customer_id from {MT_FN}(array[row(1, 5), row(3, 9)]::{MT_KEY}[]) order by 1, 2"
    ).fetchall()
    assert rows == [(1, 5), (3, 9)]


def test_the_composite_key_filter_reaches_the_index(mt):
    """The generated function's own plan for two keys, shown by auto_explain: the customers are found
    through their primary key by the keys' fields, the orders through their (tenant_id, customer_id) index."""
    define_mt(mt)
    plans: list[str] = []
    mt.add_notice_handler(lambda d: plans.append(d.message_primary or ""))
    with mt.transaction():
        mt.execute("load 'auto_explain'")
        for setting, value in [
            ("auto_explain.log_min_duration", "0"),
            ("auto_explain.log_nested_statements", "on"),
            ("auto_explain.log_level", "notice"),
            ("enable_seqscan", "off"),
        ]:
            mt.execute("select set_config(%s, %s, true)", [setting, value])
        mt.execute(f"select * from {MT_FN}(array[row(1, 5), row(2, 7)]::{MT_KEY}[])")
    plan = "\n".join(p for p in plans if "customer_total_lockstep_key" in p)
    assert "Seq Scan" not in plan, plan
    assert (
        "Index Cond: ((tenant_id = ANY ('{1,2}'::integer[])) AND (id = ANY ('{5,7}'::bigint[])))" in plan
    ), plan
    assert "Bitmap Index Scan on orders_tenant_id_customer_id_idx" in plan, plan


def test_redefining_the_same_composite_query_keeps_the_key_type_and_drop_job_removes_it(mt):
    define_mt(mt)
    key_type = mt.execute("select key_type::oid from lockstep.job").fetchone()[0]
    define_mt(mt, MT_QUERY.replace("count(o.id)", "count(o.id) * 2"))
    assert mt.execute("select key_type::oid from lockstep.job").fetchone()[0] == key_type  # the queue stays
    mt.execute("select lockstep.drop_job('mt_totals')")
    assert mt.execute("select to_regtype(%s), to_regproc(%s)", [MT_KEY, MT_FN]).fetchone() == (None, None)


def test_a_composite_key_the_query_does_not_return_is_refused(mt):
    with raises_sqlstate("LSD03", "does not return the parent column customer_id"):
        define_mt(mt, MT_QUERY.replace("c.id as customer_id", "c.id as cid"))
    assert mt.execute("select to_regtype(%s), to_regproc(%s)", [MT_KEY, MT_FN]).fetchone() == (None, None)


def test_a_target_in_a_schema_whose_name_needs_quotes(conn: psycopg.Connection) -> None:
    """The look-up of the function to replace cast the schema's name to regnamespace, which folds it to lower
    case: every query-defined job of a target in "Shop-Inv" failed with 3F000."""
    schema = SHOP.replace("shop.", '"Shop-Inv".')
    conn.execute(schema.replace("create schema shop", 'create schema "Shop-Inv"'))
    for _ in range(2):  # defined, then redefined (the function of that name replaced)
        conn.execute(
            "select lockstep.define_derived('totals', '\"Shop-Inv\".customer_total', query => %s,"
            " parent => '\"Shop-Inv\".customer', query_search_path => '\"Shop-Inv\"')",
            [QUERY],
        )
    fn = conn.execute("select compute from lockstep.job where job = 'totals'").fetchone()[0]
    assert fn == '"Shop-Inv".customer_total_lockstep_compute(bigint[])'
    assert conn.execute("select outcome from lockstep.recompute('totals')").fetchone()[0] == "done"
    assert conn.execute('select count(*) from "Shop-Inv".customer_total').fetchone()[0] == 50


def test_a_query_that_ends_with_a_line_comment(shop: psycopg.Connection) -> None:
    """lockstep wraps the query (`from (query) q where ...`): a query ending in `-- comment` swallowed the
    rest, and define_derived failed with a syntax error in a function body the user never wrote."""
    define(shop, QUERY.rstrip() + "  -- one row per customer")
    shop.execute("select lockstep.recompute('totals')")
    assert shop.execute(DIVERGENCE).fetchone()[0] == 0
    rows = shop.execute(f"select customer_id from {FN.replace('(bigint[])', '(array[3])')}").fetchall()
    assert rows == [(3,)]


OWN_COMPUTE = """
create type mt.k as (tenant_id int, id bigint);
create function mt.own(keys mt.k[])
returns table (tenant_id int, customer_id bigint, total bigint, orders bigint) language sql stable as $$
    select c.tenant_id, c.id, coalesce(sum(o.amount), 0)::bigint, count(o.id)
    from mt.customer c left join mt.orders o on o.tenant_id = c.tenant_id and o.customer_id = c.id
    where keys is null or (c.tenant_id, c.id) in (select k.tenant_id, k.id from unnest(keys) k)
    group by c.tenant_id, c.id $$;
"""


def test_a_query_jobs_key_type_goes_with_its_definition_and_leaves_the_downgrade_nothing(empty_dsn):
    """drop_job removes the key type lockstep wrote for a composite query-defined job, and the downgrade to
    0001, refused (55000) while such a job exists, then leaves no lockstep-written type or function. A
    redefinition with a compute of one's own left the generated function and key type behind for good:
    neither drop_job nor the downgrade removed them."""
    migrate(empty_dsn)
    gone = "select to_regtype(%s), to_regproc(%s)"
    with psycopg.connect(empty_dsn, autocommit=True) as c:
        c.execute(TENANTS + OWN_COMPUTE)
        define_mt(c)
        c.execute(
            "select lockstep.define_derived('mt_totals', 'mt.customer_total', 'mt.own(mt.k[])',"
            " 'mt.customer', parent_columns => array['tenant_id', 'customer_id']::name[])"
        )
        assert c.execute(gone, [MT_KEY, MT_FN]).fetchone() == (None, None)  # before: both kept
        define_mt(c)  # by a query again: its key type and function are written again
        assert c.execute("select key_type::text from lockstep.job").fetchone()[0] == MT_KEY
    with pytest.raises(sqlalchemy.exc.OperationalError, match="composite parent key") as info:
        migrate(empty_dsn, "lockstep_0001", downgrade=True)
    assert info.value.orig.sqlstate == "55000"  # sqlalchemy's error around psycopg's
    with psycopg.connect(empty_dsn, autocommit=True) as c:
        c.execute("select lockstep.drop_job('mt_totals')")
        assert c.execute(gone, [MT_KEY, MT_FN]).fetchone() == (None, None)
    migrate(empty_dsn, "lockstep_0001", downgrade=True)
    with psycopg.connect(empty_dsn, autocommit=True) as c:
        written = c.execute(
            "select count(*) from pg_type where obj_description(oid, 'pg_type') like 'lockstep:%'"
        ).fetchone()[0]
        assert written == 0
        assert c.execute(gone, [MT_KEY, MT_FN]).fetchone() == (None, None)
