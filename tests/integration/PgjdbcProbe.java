// What a JDBC tool (DBeaver's SQL editor, any JVM application) does through pgjdbc, the
// PostgreSQL JDBC driver, against headwater's postgres listener. test_postgres_jdbc.py
// runs it with Debian's driver (/usr/share/java/postgresql.jar) and checks each line:
//   java -cp /usr/share/java/postgresql.jar PgjdbcProbe.java PORT TOKEN STREAM
import java.sql.Connection;
import java.sql.DatabaseMetaData;
import java.sql.DriverManager;
import java.sql.PreparedStatement;
import java.sql.ResultSet;
import java.sql.ResultSetMetaData;
import java.sql.SQLException;
import java.sql.Statement;

public class PgjdbcProbe {
  public static void main(String[] args) throws Exception {
    String url = "jdbc:postgresql://127.0.0.1:" + args[0] + "/0?connectTimeout=15";
    String token = args[1];
    String stream = args[2];
    try (Connection ignored = DriverManager.getConnection(url, "analyst", "not-" + token)) {
      System.out.println("wrong password: accepted");
    } catch (SQLException e) {
      System.out.println("wrong password: " + e.getSQLState());
    }
    try (Connection c = DriverManager.getConnection(url, "analyst", token)) {
      System.out.println("product: " + c.getMetaData().getDatabaseProductName());
      try (Statement s = c.createStatement()) {
        int appended = s.executeUpdate("INSERT INTO " + stream + " (json) VALUES "
            + "('{\"sym\": \"A\", \"px\": 1.5}'), ('{\"sym\": \"B\", \"px\": 2}'), "
            + "('{\"sym\": \"A\", \"px\": 3}')");
        System.out.println("inserted: " + appended);
      }
      long position;
      try (Statement s = c.createStatement();
          ResultSet r = s.executeQuery("SELECT max(position) + 1 FROM " + stream)) {
        r.next();
        position = r.getLong(1);
      }
      try (Statement s = c.createStatement()) {
        s.executeUpdate("INSERT INTO " + stream + " (json) VALUES ('{\"sym\": \"C\", \"px\": 4}')");
      }
      try (Statement s = c.createStatement();
          ResultSet r = s.executeQuery("SELECT json->>'sym' AS sym, count(*) AS n, "
              + "sum((json->>'px')::DOUBLE) AS px FROM " + stream + " GROUP BY 1 ORDER BY 1")) {
        ResultSetMetaData m = r.getMetaData();
        System.out.println("types: " + m.getColumnTypeName(1) + "," + m.getColumnTypeName(2)
            + "," + m.getColumnTypeName(3));
        while (r.next()) {
          System.out.println("group: " + r.getString(1) + "," + r.getLong(2) + "," + r.getDouble(3));
        }
      }
      // pgjdbc turns a statement run prepareThreshold (5) times into a named server-side
      // statement with binary results: the sixth run takes that path.
      try (PreparedStatement p = c.prepareStatement(
          "SELECT count(*) AS n, max(ts) AS newest FROM " + stream + " WHERE json->>'sym' = ?")) {
        for (int run = 1; run <= 6; run++) {
          p.setString(1, run % 2 == 0 ? "A" : "B");
          try (ResultSet r = p.executeQuery()) {
            r.next();
            System.out.println("prepared " + run + ": " + r.getLong(1) + ","
                + (r.getTimestamp(2) != null));
          }
        }
      }
      try (Statement s = c.createStatement()) {
        s.execute("SET headwater.as_of = " + position);
        try (ResultSet r = s.executeQuery("SELECT count(*) FROM " + stream)) {
          r.next();
          System.out.println("as of: " + r.getLong(1));
        }
        s.execute("RESET headwater.as_of");
        try (ResultSet r = s.executeQuery("SELECT count(*) FROM " + stream)) {
          r.next();
          System.out.println("latest: " + r.getLong(1));
        }
      }
      // DatabaseMetaData: what a schema browser (DBeaver's navigator) draws its tree from.
      DatabaseMetaData meta = c.getMetaData();
      try (ResultSet r = meta.getSchemas()) {
        StringBuilder schemas = new StringBuilder();
        while (r.next()) {
          schemas.append(schemas.length() == 0 ? "" : ",").append(r.getString("TABLE_SCHEM"));
        }
        System.out.println("schemas: " + schemas);
      }
      try (ResultSet r = meta.getTables(null, null, "%", new String[] {"TABLE"})) {
        while (r.next()) {
          if (r.getString("TABLE_NAME").equals(stream)) {
            System.out.println("table: " + r.getString("TABLE_SCHEM") + "," + r.getString("TABLE_TYPE"));
          }
        }
      }
      try (ResultSet r = meta.getColumns(null, "main", stream, "%")) {
        while (r.next()) {
          System.out.println("column: " + r.getInt("ORDINAL_POSITION") + "," + r.getString("COLUMN_NAME")
              + "," + r.getString("TYPE_NAME") + "," + r.getInt("DATA_TYPE") + ","
              + r.getString("IS_NULLABLE"));
        }
      }
      try (ResultSet r = meta.getPrimaryKeys(null, "main", stream)) {
        int keys = 0;
        while (r.next()) {
          keys++;
        }
        System.out.println("primary key columns: " + keys);
      }
      try (ResultSet r = meta.getTypeInfo()) {
        StringBuilder names = new StringBuilder();
        while (r.next()) {
          String name = r.getString("TYPE_NAME");
          if (name.equals("int8") || name.equals("float8") || name.equals("timestamp")
              || name.equals("bytea") || name.equals("json")) {
            names.append(names.length() == 0 ? "" : ",").append(name).append("=")
                .append(r.getInt("DATA_TYPE"));
          }
        }
        System.out.println("types: " + names);
      }
      try (Statement s = c.createStatement(); ResultSet r = s.executeQuery("SELECT 1 + 1")) {
        r.next();
        System.out.println("after: " + r.getInt(1));
      }
    }
  }
}
