-- lockstep 0002 up, before the code: the state's change from 0001 (tables, types, indexes), and the
-- functions and views whose signature or columns change or that go away. The code (sql/src, frozen into
-- sql/0002/code/ at release) follows, then up_after.sql.
-- locks: ACCESS EXCLUSIVE on each table altered, for the migration's transaction.
select;

-- watch() gains through, through_column and via
drop function if exists lockstep.watch(text, regclass, name);
